"""Test graphs whose MODEL passes through a chain of nodes (Apply PARO, a LoRA, a cache or compile node, ...)
before the sampler: `test_graphs.graph`'s graph with the chain put in front of its KSampler."""

from __future__ import annotations

from test_graphs import graph


def apply_paro(plan: str | None = None, **options) -> tuple[str, dict]:
    """An Apply PARO node of the chain: with the Load PARO plan node of `plan` (a file in models/paroattn), or
    plan 'auto' (no plan connected) with `options` (density, qk, pv, block_size)."""
    inputs = {"backend": "torch", "on_mismatch": "error", "expert": "auto", **options}
    if plan is not None:
        inputs["plan"] = plan
    return "ApplyPARO", inputs


def chained(nodes: list[tuple[str, dict]], *, family: str = "wan", keep: str = "latent", record: str | None = None,
            **sampling) -> tuple[dict, list[str]]:
    """The API prompt: the model through `nodes` ((class, inputs), the model input set here; an Apply PARO's
    `plan` is a file name, loaded by a Load PARO plan node), then RecordModelCalls when `record` is set, into a
    KSampler (`sampling` replaces its inputs: steps, cfg, seed, scheduler, ...)."""
    prompt, outputs = graph(family, keep=keep)
    model = ["model", 0]
    for i, (class_type, inputs) in enumerate(nodes):
        inputs = dict(inputs)
        if class_type == "ApplyPARO" and "plan" in inputs:
            prompt[f"plan{i}"] = {"class_type": "LoadPAROPlan", "inputs": {"plan_name": inputs["plan"]}}
            inputs["plan"] = [f"plan{i}", 0]
        prompt[f"node{i}"] = {"class_type": class_type, "inputs": {"model": model, **inputs}}
        model = [f"node{i}", 0]
    if record is not None:
        prompt["record"] = {"class_type": "RecordModelCalls", "inputs": {"model": model, "key": record}}
        model = ["record", 0]
    prompt["sample"]["inputs"].update(model=model, **sampling)
    return prompt, outputs


def run_chained(nodes, runner=None, **kwargs) -> tuple[bool, str, list]:
    """(success, the error message, the messages) of running `chained(nodes, **kwargs)`."""
    import comfy_env

    prompt, outputs = chained(nodes, **kwargs)
    ok, messages = comfy_env.run(prompt, outputs, runner)
    return ok, comfy_env.error_message(messages), messages
