"""Whether a plan fits the model it is applied to and the calls it serves, and the messages that say
what to do when it does not (`PlanError`, or a warning under `on_mismatch="dense"`)."""

from __future__ import annotations

import torch

from ..errors import PlanError
from ..layout import TokenLayout
from ..plan import Plan, model_fingerprint
from .base import CallInputs, PixelScale
from .binding import BINDINGS, Binding

ON_MISMATCH = ("error", "dense")
OR_DENSE = " (or pass on_mismatch='dense' to run the model's own attention)"


def plan_problems(plan: Plan, binding: Binding) -> list[str]:
    """Ways `plan` does not fit the bound transformer (empty when it fits)."""
    problems = []
    if plan.model_class and plan.model_class != binding.transformer_class:
        problems.append(f"plan was calibrated for {plan.model_class}; this model is {binding.transformer_class}")
    heads = {int(m.heads) for m in binding.modules}
    if heads != {plan.num_heads}:
        found = ", ".join(str(h) for h in sorted(heads))
        problems.append(f"plan has {plan.num_heads} heads per layer; this model has {found}")
    if plan.num_layers != len(binding.modules):
        problems.append(
            f"plan has {plan.num_layers} self-attention layers; this model has {len(binding.modules)}"
            + (" (a layer is missing from the plan)" if plan.num_layers < len(binding.modules) else "")
        )
    actual = model_fingerprint(binding.transformer.config)
    if plan.model_fingerprint and plan.model_fingerprint != actual:
        problems.append(
            f"plan was calibrated for a model config with fingerprint {plan.model_fingerprint}; this model's "
            f"config has {actual} (another checkpoint or size)"
        )
    return problems


def layout_problem(plan: Plan, binding: Binding, inputs: CallInputs, scale: PixelScale, shapes=None) -> str | None:
    """Why `plan` does not fit the tokens of this call (None when it does), with the command that fixes it.
    `shapes` (`shapes.ShapePlans` of the plan): the plan fits every size it was calibrated at or can
    derive masks for; otherwise the message ends with why it cannot."""
    plan_layout = plan.layout
    family, transformer = binding.family, binding.transformer
    if inputs.layout is None:
        return f"this call has no PARO token layout: {inputs.problem}"
    if inputs.layout == plan_layout:
        return None
    why_not = "" if shapes is None else shapes.problem(inputs.layout)
    if why_not is None:  # another calibrated size, or one the plan derives masks for
        return None
    why_not = f"; {why_not}" if why_not else ""
    if (inputs.layout.frames, inputs.layout.height, inputs.layout.width) == (plan_layout.frames, plan_layout.height,
                                                                             plan_layout.width):
        planned, found = plan_layout.prefix + plan_layout.suffix, inputs.layout.prefix + inputs.layout.suffix
        return (
            f"plan was calibrated with {planned} text tokens; this call has {found}: "
            f"pass max_sequence_length={planned} to the pipeline, or run "
            f"`{family.calibrate_command(transformer, inputs.layout, scale)}` with the pipeline's text length{why_not}"
        )
    return (
        f"plan was calibrated for {plan_layout} tokens ({family.describe_size(transformer, plan_layout, scale)}); "
        f"this call has {inputs.layout} ({family.describe_size(transformer, inputs.layout, scale)}): run "
        f"`{family.calibrate_command(transformer, inputs.layout, scale)}` for this size{why_not}"
    )


@torch._dynamo.assume_constant_result
def traced_layout_problem(token: str, shape: tuple[int, ...] | None, problem: str | None) -> str | None:
    """`layout_problem` of a traced forward whose layout is `TokenLayout(*shape)`, formatted eagerly while
    the graph is traced (dynamo calls this as a constant function); a mismatch under on_mismatch="error"
    raises its PlanError here."""
    binding = BINDINGS[token]
    inputs = CallInputs(0.0, None if shape is None else TokenLayout(*shape), problem)
    processor = binding.processor
    message = layout_problem(processor.plan, binding, inputs, processor.scale(binding), processor.shapes)
    if message is not None and binding.processor.on_mismatch == "error":
        raise PlanError(message + OR_DENSE)
    return message
