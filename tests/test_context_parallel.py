"""PARO under diffusers' context parallelism (Ulysses), on CPU: two processes joined with gloo run tiny Wan, FLUX.1,
FLUX.2, Qwen-Image, LTX-Video, LTX-2, CogVideoX, HunyuanVideo 1 and 1.5, SkyReels-V2 and Wan VACE transformers with
`enable_parallelism(ContextParallelConfig(ulysses_degree=2), cp_plan=context_parallel_plan(transformer))` and must give
what one process gives with the same plan, each running its own slice of the plan's heads, and the model's own
attention through PARO's processor (a plan dense in every layer) must give the model's own output; so must a tiny Wan
2.2 expert pair generating with a plan per expert, a per-token timestep that diffusers splits with the sequence (every
GPU picks one process's bucket), SkyReels-V2's per-frame timesteps of diffusion forcing, and PARO under
`torch.compile(fullgraph=True)`. The exchange itself is checked on its own for every way a family's plan lays the text
out, with chunks of equal and of unequal length (`ulysses_anything`). Ring attention, head counts the degree does not
divide, transformers without a plan or whose plan does not hold (HunyuanVideo's first-frame token replacement),
calibration capture and frame binding are refused with what to do; a plan balanced for another number of GPUs warns.
`apply(pipe, "auto")` on a miss learns under Ulysses, each process recording its heads, the plan one process learns.

diffusers places each process on accelerator `rank % torch.accelerator.device_count()`, which is 0 on CPU: the
workers patch it to 1 and pass a CPU device mesh. One spawn runs every distributed case (the imports dominate)."""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from diffusers import ContextParallelConfig, ParallelConfig
from tiny_models import TINY_BLOCK, tiny_call_kwargs, tiny_forward_inputs, tiny_transformer

from paroattn import Plan, PlanError, TokenLayout
from paroattn.pipelines import (
    PAROProcessor,
    apply,
    capture_attention,
    family_of,
    pipeline_experts,
    self_attention_layers,
)
from paroattn.pipelines.context_parallel import (
    context_parallel_plan,
    enable_ulysses,
    sequence_problem,
    ulysses_problem,
)
from paroattn.plan import model_fingerprint

WORLD = 2
HEADS = 4  # two per process: each holds a contiguous slice of more than one head
TIMESTEPS = (800.0, 200.0)  # one per bucket of the two-bucket plans
JOIN_TIMEOUT_S = 900  # a loaded 2-core machine; the processes take a few minutes there
PAIR_LAYOUT = TokenLayout(0, 3, 4, 4)  # tiny_pipeline("wan2.2") at tiny_call_kwargs' size: 9 frames of 64 x 64
PAIR_STEPS = 4  # two on each expert
# every family: those with diffusers' own context-parallel plan (text and grid split in chunks), then those whose plan
# paroattn gives (CogVideoX and HunyuanVideo: the text whole on every GPU)
ULYSSES_FAMILIES = ("wan", "flux", "flux2", "qwen_image", "ltx", "ltx2", "cogvideox", "hunyuan_video", "hunyuan_video15",
                    "skyreels_v2", "wan_vace")


# the families of Wan's blocks, whose own attention under Ulysses gives one process's output bit for bit
WAN_BLOCKS = ("wan", "skyreels_v2", "wan_vace")


def make_plan(transformer, inputs, *, seed=3, heads=HEADS, density=0.5) -> Plan:
    """Random orders and masks at `density` (0.5: every head differs from every other)."""
    return Plan.synthetic(
        layout=family_of(transformer).call_inputs(transformer, inputs).layout,
        num_layers=len(self_attention_layers(transformer)), num_heads=heads, density=density, orders="random",
        num_buckets=2, block_size=TINY_BLOCK, model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config), seed=seed,
    )


def run(transformer, inputs):
    with torch.no_grad():
        return transformer(**inputs)[0]


# -- the distributed run ------------------------------------------------------------------------------------------


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("ring", "ulysses"))


def _enable_ulysses(transformer) -> None:
    enable_ulysses(transformer, WORLD)  # enable_parallelism with the family's plan, then the adapter's settings


def dense_plan(transformer, inputs) -> Plan:
    """A plan that runs every layer with the model's own attention (through PARO's processor)."""
    plan = make_plan(transformer, inputs, density=1.0)
    plan.dense[:] = True
    return plan


def _one_process_then_ulysses(transformer, calls) -> tuple[Plan, list]:
    """A plan for `transformer` and its outputs on `calls` with PARO on this process alone; then the transformer
    is put under Ulysses 2 (`enable_parallelism` with the family's context-parallel plan)."""
    plan = make_plan(transformer, calls[0])
    with apply(transformer, plan, backend="torch"):
        single = [run(transformer, inputs) for inputs in calls]
    _enable_ulysses(transformer)
    return plan, single


def _captured(transformer, calls, context_parallel: bool = False) -> tuple[list, list]:
    """The outputs of `calls` under `capture_attention`, and what its callback got at each self-attention call."""
    seen = []

    def record(layer, q, k, layout, timestep, suffix_mask):
        seen.append((layer, q.clone(), k.clone(), layout, timestep, suffix_mask))

    with capture_attention(transformer, record, context_parallel=context_parallel):
        return [run(transformer, inputs) for inputs in calls], seen


def _ulysses_family(family: str, rank: int) -> dict:
    """PARO on one process, then under Ulysses 2 with the plan applied after and before enable_parallelism."""
    transformer = tiny_transformer(family, heads=HEADS)
    calls = [tiny_forward_inputs(transformer, timestep=t) for t in TIMESTEPS]
    if family == "ltx":
        # LTX's own cross-attention processor expands a text mask to every head before diffusers' Ulysses exchange
        # gives each GPU half of them, and fails (diffusers 0.42.1, with or without PARO): no text mask here
        calls = [{**inputs, "encoder_attention_mask": None} for inputs in calls]
    if family == "ltx2":
        # the same for LTX-2's text masks; and its audio-video cross-attention fails under diffusers' own context
        # parallelism (the video side's cross-attention RoPE is not split with the video): modalities isolated
        calls = [{**inputs, "encoder_attention_mask": None, "audio_encoder_attention_mask": None,
                  "isolate_modalities": True} for inputs in calls]
    own = [run(transformer, inputs) for inputs in calls]  # the model's own attention, on this process alone
    captured = _captured(transformer, calls)
    plan, single = _one_process_then_ulysses(transformer, calls)
    found = {"plan_orders": plan.orders.clone(), "mask_blocks": plan.mask_blocks, "single": single, "own": own,
             "capture_single": captured, "capture_ulysses": _captured(transformer, calls, context_parallel=True)}
    if family in WAN_BLOCKS:  # the model's own attention under Ulysses, no PARO anywhere
        found["own_ulysses"] = [run(transformer, inputs) for inputs in calls]
    with apply(transformer, dense_plan(transformer, calls[0]), backend="torch"):
        found["dense"] = [run(transformer, inputs) for inputs in calls]
    with apply(transformer, plan, backend="torch") as handle:  # after enable_parallelism: copied from the original
        found["after"] = [run(transformer, inputs) for inputs in calls]
        processor = handle.processor
        found["heads"] = processor._ulysses.heads
        found["head_orders"] = processor.head_plan.orders.clone()
        store = processor.runner.stores[processor.runner.latest]
        found["mask_heads"] = {tuple(store.get(b, 0).shape) for b in range(plan.num_buckets)}
        from paroattn.runner import list_bytes

        found["list_bytes"] = (list_bytes(processor.head_plan), list_bytes(plan))
    with apply(transformer, plan, backend="torch", fuse_rope=False):  # the model's own RoPE before the exchange
        found["unfused_rope"] = [run(transformer, inputs) for inputs in calls]
    with apply(transformer, plan, backend="torch", exchange_groups=2):  # each GPU's 2 heads exchanged one by one
        found["pipelined"] = [run(transformer, inputs) for inputs in calls]
    with apply(transformer, dense_plan(transformer, calls[0]), backend="torch", exchange_groups=2):
        found["dense_pipelined"] = [run(transformer, inputs) for inputs in calls]

    before = tiny_transformer(family, heads=HEADS)  # enable_parallelism cannot be called twice on one model
    with apply(before, plan, backend="torch"):  # before enable_parallelism: diffusers sets the processor's config
        _enable_ulysses(before)
        found["before"] = [run(before, inputs) for inputs in calls]
    return found


def _per_token_timesteps(rank: int) -> dict:
    """Tiny Wan with a per-token timestep [B, N] (Wan 2.2 TI2V's `expand_timesteps`), which diffusers' context-parallel
    plan splits with the sequence: the first 24 of 48 tokens at t = 0, the rest at the call's t, so the first GPU's
    chunk holds zeros only. One process buckets the call by its largest timestep; every GPU must pick that bucket."""
    transformer = tiny_transformer("wan", heads=HEADS)
    calls = []
    for t in TIMESTEPS:
        inputs = tiny_forward_inputs(transformer, timestep=t)
        batch, _, frames, height, width = inputs["hidden_states"].shape
        tokens = frames * (height // 2) * (width // 2)  # patches of 1 x 2 x 2
        per_token = torch.full((batch, tokens), float(t))
        per_token[:, : tokens // 2] = 0.0
        calls.append({**inputs, "timestep": per_token})
    plan, single = _one_process_then_ulysses(transformer, calls)
    found = {"single": single}
    with apply(transformer, plan, backend="torch"):
        found["ulysses"] = [run(transformer, inputs) for inputs in calls]
    return found


def _diffusion_forcing(rank: int) -> dict:
    """Tiny SkyReels-V2 with diffusion forcing's timesteps, one per latent frame (4, split with the frames: 2 per GPU)."""
    transformer = tiny_transformer("skyreels_v2", heads=HEADS)
    calls = []
    for t in TIMESTEPS:
        inputs = tiny_forward_inputs(transformer, timestep=t, frames=4)
        frames = torch.tensor([t, t - 50.0, t - 100.0, 0.0])  # the noisiest frame decides the bucket
        calls.append({**inputs, "timestep": frames.expand(2, -1).clone(), "enable_diffusion_forcing": True})
    plan, single = _one_process_then_ulysses(transformer, calls)
    found = {"single": single}
    with apply(transformer, plan, backend="torch"):
        found["ulysses"] = [run(transformer, inputs) for inputs in calls]
        odd = tiny_forward_inputs(transformer, frames=3)  # 3 latent frames do not split over 2 GPUs
        try:
            run(transformer, {**odd, "timestep": torch.full((2, 3), 500.0), "enable_diffusion_forcing": True})
        except PlanError as exc:
            found["odd_frames"] = str(exc)
    return found


# every way a family's plan lays its text out, with chunks of equal and of unequal length
EXCHANGE_CASES = [
    (TokenLayout(6, 2, 2, 4), "split"), (TokenLayout(5, 3, 3, 3), "split"), (TokenLayout(0, 3, 3, 3), "split"),
    (TokenLayout(6, 2, 2, 4), "whole"), (TokenLayout(5, 3, 3, 3), "whole"),
    (TokenLayout(0, 2, 2, 4, suffix=6), "whole"), (TokenLayout(0, 3, 3, 3, suffix=7), "whole"),
]


def _chunk(x: torch.Tensor, layout: TokenLayout, text: str, rank: int, dim: int) -> torch.Tensor:
    """GPU `rank`'s chunk of `x` (the whole sequence along `dim`) as diffusers splits it: each run in
    `torch.tensor_split`'s chunks (equal ones where they divide), a text the plan keeps whole left whole."""
    prefix, grid = layout.prefix, layout.grid_tokens
    parts = x.split([prefix, grid, layout.suffix], dim=dim)
    mine = [part.tensor_split(WORLD, dim=dim)[rank] for part in parts]
    if text == "whole":
        mine = [parts[0], mine[1], parts[2]]
    return torch.cat(mine, dim=dim)


def _local_output(inputs, groups: int, per_gpu: int) -> torch.Tensor:
    """What `_exchange`'s attention gives back to a GPU's chunk: v * (1 + the first head of its group) - q per head,
    the group counted within each GPU's slice of the heads."""
    q, _, v = inputs
    first = torch.tensor([(h % per_gpu) // (per_gpu // groups) * (per_gpu // groups) for h in range(q.shape[1])])
    return v * (1 + first.view(1, -1, 1, 1)) - q


def _exchange(rank: int) -> dict:
    """`UlyssesShard`'s exchanges on their own: each GPU's chunk -> its heads over the whole sequence and back, and the
    rotary tables (over the whole chunk, or CogVideoX's: all of it but the text before the grid)."""
    from paroattn.pipelines.context_parallel import UlyssesShard

    found = {}
    for case, (layout, text) in enumerate(EXCHANGE_CASES):
        uneven = any(n % WORLD for n in (layout.prefix, layout.grid_tokens, layout.suffix))
        config = ContextParallelConfig(ulysses_degree=WORLD, mesh=_mesh((1, WORLD)), ulysses_anything=uneven)
        config.setup(rank, WORLD, torch.device("cpu"), config.mesh)
        shard = UlyssesShard(config, HEADS, text)
        split = shard.split(layout)
        g = torch.Generator().manual_seed(case)
        whole = torch.randn(2, HEADS, layout.seq_len, 8, generator=g)
        mine = slice(*shard.heads)
        inputs = tuple(_chunk(x, layout, text, rank, dim=2).transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D]
                       for x in (whole, whole.roll(1, dims=1), whole.flip(2)))  # q, k, v of different heads and tokens
        found[case] = {"uneven": uneven and not split.equal, "default_groups": shard.groups}
        for groups in (1, 2):  # all heads at once; then one group per head, pipelined
            seen = []

            def attention(q, k, v, heads):
                seen.append((heads, q.clone(), k.clone(), v.clone()))
                return v * (1 + heads[0]) - q  # the output of each group's heads, which must come back in place

            out = shard.attend(inputs, split, attention, groups=groups)
            q, k, v = (x[:, mine] for x in (whole, whole.roll(1, dims=1), whole.flip(2)))
            expected = [((h0, h1), q[:, h0:h1], k[:, h0:h1], v[:, h0:h1])
                        for h0, h1 in [(i * 2 // groups, (i + 1) * 2 // groups) for i in range(groups)]]
            found[case][groups] = {
                "gather": len(seen) == groups and all(a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))
                                                      for a, b in zip(seen, expected)),
                "scatter": torch.equal(out, _local_output(inputs, groups, HEADS // WORLD)),
                "layout": out.transpose(1, 2).is_contiguous()}
        tables = torch.randn(layout.seq_len, 8, generator=g), torch.randn(layout.seq_len, 8, generator=g)
        rotary = shard.gather_rotary(tuple(_chunk(t, layout, text, rank, dim=0) for t in tables), split)
        found[case]["rotary"] = all(torch.equal(a, b) for a, b in zip(rotary, tables, strict=True))
        if text == "whole" and layout.prefix:  # tables of the grid only, after the text (CogVideoX)
            grid = tuple(t[layout.prefix:] for t in tables)
            mine_grid = tuple(t.tensor_split(WORLD)[rank] for t in grid)
            rotary = shard.gather_rotary(mine_grid, split)
            found[case]["grid_rotary"] = all(torch.equal(a, b) for a, b in zip(rotary, grid, strict=True))
    return found


def _balance_warning(rank: int) -> dict:
    """A plan balanced for 3 GPUs (6 heads), run under Ulysses 2: correct output, and a warning saying the GPUs' work
    differs; one balanced for 2 runs without it."""
    from paroattn.plan.balance import balance_plan

    transformer = tiny_transformer("wan", heads=6)
    inputs = tiny_forward_inputs(transformer)
    plan = Plan.synthetic(layout=family_of(transformer).call_inputs(transformer, inputs).layout,
                          num_layers=len(self_attention_layers(transformer)), num_heads=6, density=0.5,
                          block_size=TINY_BLOCK, model_class=type(transformer).__name__,
                          model_fingerprint=model_fingerprint(transformer.config), profiles=True, seed=7)
    _enable_ulysses(transformer)
    found = {}
    for ranks in (3, 2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with apply(transformer, balance_plan(plan, ranks), backend="torch"):
                found[ranks] = {"out": run(transformer, inputs),
                                "warnings": [str(w.message) for w in caught if "balanced for" in str(w.message)]}
    return found


def _expert_pair(rank: int) -> dict:
    """A tiny Wan 2.2 pair, a plan per expert, generating on one process and then with both experts under Ulysses 2."""
    from tiny_models import tiny_pipeline

    pipe = tiny_pipeline("wan2.2")
    pipe.set_progress_bar_config(disable=True)
    plans = []
    for i, (name, expert) in enumerate(pipeline_experts(pipe)):
        plan = Plan.synthetic(
            layout=PAIR_LAYOUT, num_layers=len(self_attention_layers(expert)),
            num_heads=expert.config.num_attention_heads, density=0.5, orders="random", num_buckets=2,
            block_size=TINY_BLOCK, model_class=type(expert).__name__, model_fingerprint=model_fingerprint(expert.config),
            seed=5 + i,
        )
        plan.expert = name
        plans.append(plan)
    kwargs = {**tiny_call_kwargs("wan2.2"), "num_inference_steps": PAIR_STEPS, "output_type": "latent"}

    def latents():
        with torch.no_grad():
            return pipe("a cat runs on the beach", generator=torch.Generator().manual_seed(0), **kwargs).frames

    found = {"dense": latents()}
    with apply(pipe, plans, backend="torch"):
        found["single"] = latents()
    for _, expert in pipeline_experts(pipe):
        _enable_ulysses(expert)
    with apply(pipe, plans, backend="torch") as handle:
        found["ulysses"] = latents()
        found["heads"] = {name: expert.processor._ulysses.heads for name, expert in handle.experts.items()}
        found["head_orders"] = {name: expert.processor.head_plan.orders.clone() for name, expert in handle.experts.items()}
    found["plan_orders"] = {plan.expert: plan.orders.clone() for plan in plans}
    return found


def _compiled(rank: int) -> dict:
    """PARO on tiny Wan under Ulysses 2 and `torch.compile(fullgraph=True)`, through both buckets."""
    import logging

    from torch._dynamo.testing import CompileCounterWithBackend

    transformer = tiny_transformer("wan", heads=HEADS)
    calls = [tiny_forward_inputs(transformer, timestep=t) for t in TIMESTEPS]
    plan, single = _one_process_then_ulysses(transformer, calls)
    found = {"single": single}
    # what diffusers 0.42's context parallelism needs before fullgraph compiling, dense and PARO alike (README): an
    # eager forward first (tracing the first one fails on a `hasattr` in its hooks) and dynamo told to skip the
    # hooks' Logger.warning_once (transformers' method, which it cannot trace)
    torch._dynamo.config.ignore_logging_functions.add(logging.Logger.warning_once)
    counter = CompileCounterWithBackend("aot_eager")
    with apply(transformer, plan, backend="torch"):
        run(transformer, calls[0])
        compiled = torch.compile(transformer, fullgraph=True, backend=counter)
        found["compiled"] = [run(compiled, inputs) for inputs in calls]
    found["graphs"] = counter.frame_count
    torch._dynamo.reset()
    with apply(transformer, plan, backend="torch", exchange_groups=2):  # the pipelined exchange, traced
        run(transformer, calls[0])
        compiled = torch.compile(transformer, fullgraph=True, backend="aot_eager")
        found["compiled_pipelined"] = [run(compiled, inputs) for inputs in calls]
    return found


def _refusals(rank: int) -> dict:
    found = {}
    transformer = tiny_transformer("wan", heads=HEADS)
    plan = make_plan(transformer, tiny_forward_inputs(transformer))
    with apply(transformer, plan, backend="torch"):
        try:
            transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=WORLD, mesh=_mesh((WORLD, 1))))
        except PlanError as exc:
            found["ring"] = str(exc)
    enabled = tiny_transformer("wan", heads=HEADS)
    _enable_ulysses(enabled)
    try:  # 3 groups of the 2 heads each GPU runs
        apply(enabled, make_plan(enabled, tiny_forward_inputs(enabled)), backend="torch", exchange_groups=3)
    except ValueError as exc:
        found["groups"] = str(exc)
    lone = tiny_transformer("flux", heads=HEADS)
    inputs = tiny_forward_inputs(lone)
    lone.set_attn_processor(PAROProcessor(make_plan(lone, inputs), backend="torch"))
    lone.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD, mesh=_mesh((1, WORLD))))
    try:
        run(lone, inputs)
    except RuntimeError as exc:
        found["lone"] = str(exc)
    return found


def _generate(rank: int, folder: Path) -> dict:
    """`paro generate --ulysses 2` of a tiny FLUX pipeline against the same generation on one process."""
    from paroattn.app import generate as generate_module

    written = []
    write = generate_module._write

    def spy(pixels, path, video, fps):
        written.append(str(path))
        return write(pixels, path, video, fps)

    generate_module._write = spy
    kwargs = {"plan": folder / "plan.safetensors", "height": 96, "width": 96, "steps": 2, "backend": "torch",
              "extra_call": {"guidance_scale": 3.5}, "log": lambda message: None}
    result = generate_module.generate(folder / "model", "a red car", out=folder / "ulysses.png", ulysses=WORLD, **kwargs)
    found = {"result": result, "written": list(written)}
    if rank == 0:
        found["single"] = generate_module.generate(folder / "model", "a red car", out=folder / "single.png", **kwargs)
    # --plan auto: a run that learns (every process recording its heads), then one that runs the cached plan; and the
    # same two runs on one process with a cache of its own
    auto = {**kwargs, "plan": "auto", "density": 0.5}
    for name, ulysses in (("auto", WORLD), ("auto_single", 1)):
        if ulysses == 1 and rank != 0:
            continue
        os.environ["PAROATTN_CACHE"] = str(folder / f"{name}-cache")
        del written[:]
        found[name] = [generate_module.generate(folder / "model", "a red car", out=folder / f"{name}{run}.png",
                                                ulysses=ulysses, **auto) for run in (1, 2)]
        found[name + "_written"] = list(written)
        found[name + "_entries"] = sorted(p.name for p in (folder / f"{name}-cache").iterdir())
    # CogVideoX, whose own attention runs under Ulysses through PARO's processor: --compare's dense run and the PARO
    # run, as the pixels handed to the writer, against one process's
    pixels = {}

    def keep(array, path, video, fps):
        pixels[Path(path).name] = array
        return path

    generate_module._write = keep
    kwargs = {"plan": folder / "cogvideox_plan.safetensors", "height": 64, "width": 64, "frames": 9, "steps": 2,
              "backend": "torch", "compare": True, "extra_call": {"use_dynamic_cfg": False}, "log": lambda message: None}
    generate_module.generate(folder / "cogvideox", "a red car", out=folder / "cog_ulysses.gif", ulysses=WORLD, **kwargs)
    if rank == 0:
        generate_module.generate(folder / "cogvideox", "a red car", out=folder / "cog_single.gif", **kwargs)
        try:
            generate_module.generate(folder / "cogvideox", "a red car", out=folder / "cog_no_plan.gif", ulysses=WORLD,
                                     **{**kwargs, "plan": None, "compare": False})
        except ValueError as exc:
            found["no_plan"] = str(exc)
    found["cogvideox"] = pixels
    generate_module._write = write
    return found


def _auto_plan(rank: int, folder: Path) -> dict:
    """`apply(pipe, "auto")` on a miss under Ulysses 2 (tiny Wan pipeline, 4 heads: 2 recorded per process), against
    one process learning the plan without parallelism on the same prompt and seed; then a generation that fails on
    the second process, and a hit in a fresh pipeline."""
    import torch.distributed as dist
    from diffusers import WanPipeline
    from tiny_models import tiny_pipeline

    import paroattn

    def pipeline(ulysses: bool):
        pipe = WanPipeline(**{**tiny_pipeline("wan").components, "transformer": tiny_transformer("wan", heads=HEADS)})
        pipe.set_progress_bar_config(disable=True)
        if ulysses:
            _enable_ulysses(pipe.transformer)
        return pipe

    def generate(pipe, family="wan", **extra):
        kwargs = {**tiny_call_kwargs(family), "output_type": "latent", **extra}
        with torch.no_grad():
            return pipe("a red ball", generator=torch.Generator().manual_seed(0), **kwargs).frames

    options = {"density": 0.5, "block_size": TINY_BLOCK, "backend": "torch", "log": lambda message: None}
    found = {}
    single = pipeline(ulysses=False)
    found["single_dense"] = generate(single)
    with paroattn.apply(single, "auto", cache=folder / f"single{rank}", **options) as handle:
        generate(single)
        found["single_sparse"] = generate(single)
        found["single_plan"] = handle.plan

    pipe = pipeline(ulysses=True)
    found["dense"] = generate(pipe)  # the model's own attention under Ulysses
    cache = folder / "auto"
    handle = paroattn.apply(pipe, "auto", cache=cache, **options)
    found["first"] = generate(pipe)
    dist.barrier()
    found["entries"] = sorted(p.name for p in cache.iterdir())
    found["learnt"], found["captured"], found["plan"] = handle.learnt, handle.captured, handle.plan
    found["second"] = generate(pipe)
    found["captured_after"] = handle.captured
    found["heads"] = handle.handle.processor._ulysses.heads
    handle.remove()

    fresh = pipeline(ulysses=True)  # a hit: every process loads the entry
    with paroattn.apply(fresh, "auto", cache=cache, **options) as hit:
        found["hit"] = generate(fresh)
        found["hit_learnt"] = hit.learnt

    failing = pipeline(ulysses=True)
    steps = tiny_call_kwargs("wan")["num_inference_steps"]

    def fail_on_second(pipe, step, timestep, kwargs):
        if rank == 1 and step == steps - 1:  # after the last transformer call: the first process finishes its own
            raise ValueError("the second process failed")
        return {}

    failed = folder / "failed"
    with paroattn.apply(failing, "auto", cache=failed, **options) as handle:
        try:
            generate(failing, callback_on_step_end=fail_on_second)
        except (ValueError, RuntimeError) as exc:
            found["failure"] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        found["failed_entries"] = sorted(p.name for p in failed.iterdir()) if failed.exists() else []
        found["failed_plan"] = handle.plan
        dist.barrier()  # both looked before the next generation takes the lock
        generate(failing)  # the next generation learns it
        found["relearnt"] = handle.plan is not None and (failed / handle.path.name).is_file()

    # another process holds the entry's lock: every process runs dense and writes nothing. CogVideoX: its own
    # attention cannot run under Ulysses but through PARO's exchange (the text whole on every GPU)
    from paroattn.runner.cache import EntryLock

    found["cog_dense"] = generate(tiny_pipeline("cogvideox"), "cogvideox")
    cog = tiny_pipeline("cogvideox")
    _enable_ulysses(cog.transformer)
    lines = []
    with paroattn.apply(cog, "auto", cache=folder / "waiting", **{**options, "log": lines.append}) as handle:
        holder = EntryLock(handle.path)
        if rank == 0:
            assert holder.acquire()  # as another process learning the plan would
        dist.barrier()
        found["cog_waiting"] = generate(cog, "cogvideox")
        found["cog_waiting_state"] = {"plan": handle.plan, "captured": handle.captured, "log": lines[-1],
                                      "entries": sorted(p.name for p in (folder / "waiting").iterdir())}
        dist.barrier()
        holder.release()
    return found


def _worker(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.accelerator.device_count = lambda: 1  # 0 on CPU, which diffusers divides by
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    folder = Path(folder)
    results = {"auto": _auto_plan(rank, folder)}
    results.update({family: _ulysses_family(family, rank) for family in ULYSSES_FAMILIES})
    results.update({"pair": _expert_pair(rank), "per_token": _per_token_timesteps(rank),
                    "forcing": _diffusion_forcing(rank), "exchange": _exchange(rank),
                    "balance": _balance_warning(rank),
                    "compiled": _compiled(rank)})  # last: it changes dynamo's config in this process
    results.update(_refusals(rank))
    results["generate"] = _generate(rank, folder)
    torch.save(results, folder / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two processes found, [rank 0, rank 1]."""
    from tiny_models import tiny_pipeline

    folder = tmp_path_factory.mktemp("ulysses")
    pipe = tiny_pipeline("flux")
    pipe.save_pretrained(folder / "model")
    make_plan(pipe.transformer, tiny_forward_inputs(pipe.transformer), heads=2).save(folder / "plan.safetensors")
    cogvideox = tiny_pipeline("cogvideox")
    cogvideox.save_pretrained(folder / "cogvideox")
    inputs = tiny_forward_inputs(cogvideox.transformer, batch=1)
    make_plan(cogvideox.transformer, inputs, heads=2).save(folder / "cogvideox_plan.safetensors")
    context = mp.start_processes(_worker, args=(_free_port(), str(folder)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:  # a collective that one process never reached
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD} processes did not finish within {JOIN_TIMEOUT_S} s")
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("family", WAN_BLOCKS)
@pytest.mark.slow
def test_own_attention_under_ulysses_is_one_process_bit_for_bit(ranks, family):
    # SkyReels-V2's processor would gather the whole text from every GPU as cross-attention keys (N copies of it):
    # the same result up to rounding, so only bit equality shows that each GPU attends its own queries to the text
    for found in ranks:
        for own, parallel in zip(found[family]["own"], found[family]["own_ulysses"], strict=True):
            assert torch.equal(parallel, own)


@pytest.mark.parametrize("family", ULYSSES_FAMILIES)
@pytest.mark.parametrize("order", ["after", "before", "unfused_rope", "pipelined"])
@pytest.mark.slow
def test_paro_under_ulysses_equals_one_process(ranks, family, order):
    for found in ranks:
        for single, parallel in zip(found[family]["single"], found[family][order]):
            assert parallel.shape == single.shape
            torch.testing.assert_close(parallel, single, rtol=1e-5, atol=1e-6)
    # and the buckets differ, so both were exercised
    assert not torch.allclose(ranks[0][family]["single"][0], ranks[0][family]["single"][1])


@pytest.mark.parametrize("family", ULYSSES_FAMILIES)
@pytest.mark.slow
def test_the_models_own_attention_through_paro_under_ulysses_equals_the_model(ranks, family):
    """A plan dense in every layer: the model's own attention on each GPU's heads (PARO's exchange for CogVideoX and
    HunyuanVideo, whose own processors cannot run under Ulysses; diffusers' dispatcher for the others)."""
    for found in ranks:
        for own, parallel, pipelined in zip(found[family]["own"], found[family]["dense"],
                                            found[family]["dense_pipelined"], strict=True):
            torch.testing.assert_close(parallel, own, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(pipelined, own, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ULYSSES_FAMILIES)
@pytest.mark.slow
def test_capture_under_ulysses_gives_each_process_its_heads_of_the_whole_sequence(ranks, family):
    """`capture_attention(..., context_parallel=True)`: each process's callback gets its heads of what one process's
    capture gets (every token, in [prefix ; grid ; suffix] order), and the output is the model's own."""
    per_gpu = HEADS // WORLD
    for rank, found in enumerate(ranks):
        found = found[family]
        outputs, seen = found["capture_ulysses"]
        for parallel, own in zip(outputs, found["own"], strict=True):
            torch.testing.assert_close(parallel, own, rtol=1e-5, atol=1e-6)
        heads = slice(rank * per_gpu, (rank + 1) * per_gpu)
        for (layer, q, k, layout, t, mask), (layer1, q1, k1, layout1, t1, mask1) in zip(
                seen, found["capture_single"][1], strict=True):
            assert (layer, layout, t) == (layer1, layout1, t1) and q.shape[1] == per_gpu
            torch.testing.assert_close(q, q1[:, heads], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(k, k1[:, heads], rtol=1e-5, atol=1e-6)
            assert (mask is None and mask1 is None) or torch.equal(mask, mask1)


@pytest.mark.parametrize("family", ULYSSES_FAMILIES)
@pytest.mark.slow
def test_each_process_runs_its_contiguous_slice_of_the_heads(ranks, family):
    per_gpu = HEADS // WORLD
    for rank, found in enumerate(ranks):
        found = found[family]
        assert found["heads"] == (rank * per_gpu, (rank + 1) * per_gpu)
        assert torch.equal(found["head_orders"], found["plan_orders"][:, rank * per_gpu:(rank + 1) * per_gpu])
        assert found["mask_heads"] == {(per_gpu, *found["mask_blocks"])}  # the bool masks the layers read
        head_bytes, plan_bytes = found["list_bytes"]
        # lists are padded to the longest row of the heads they hold: a GPU's slice takes at most 1/N
        assert 0 < head_bytes * WORLD <= plan_bytes
    assert not torch.equal(ranks[0][family]["head_orders"], ranks[1][family]["head_orders"])


@pytest.mark.slow
def test_per_token_timesteps_bucket_every_gpu_as_one_process(ranks):
    for found in ranks:
        found = found["per_token"]
        for single, parallel in zip(found["single"], found["ulysses"], strict=True):
            torch.testing.assert_close(parallel, single, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_diffusion_forcing_timesteps_split_with_their_frames(ranks):
    for found in ranks:
        found = found["forcing"]
        for single, parallel in zip(found["single"], found["ulysses"], strict=True):
            torch.testing.assert_close(parallel, single, rtol=1e-5, atol=1e-6)
        assert "3 latent frames must be divisible by ulysses_degree=2" in found["odd_frames"]


@pytest.mark.parametrize("case", range(len(EXCHANGE_CASES)))
@pytest.mark.slow
def test_the_exchange_gives_each_gpu_its_heads_of_the_whole_sequence_and_back(ranks, case):
    layout, text = EXCHANGE_CASES[case]
    for found in ranks:
        found = found["exchange"][case]
        for groups in (1, 2):
            assert found[groups]["gather"] and found[groups]["scatter"] and found[groups]["layout"], (groups, found)
        assert found["rotary"] and found["default_groups"] == 1  # one exchange unless pipelining is asked for
        assert found.get("grid_rotary", True)
    # the cases with token counts two GPUs do not divide ran the exchange of unequal chunks
    assert ranks[0]["exchange"][case]["uneven"] == any(n % WORLD for n in (layout.grid_tokens, layout.suffix,
                                                                            layout.prefix if text == "split" else 0))


@pytest.mark.slow
def test_a_plan_balanced_for_other_gpus_warns_and_runs_right(ranks):
    for found in ranks:
        found = found["balance"]
        assert len(found[3]["warnings"]) == 1 and "balanced for 3 GPUs" in found[3]["warnings"][0]
        assert "balance_ranks=2" in found[3]["warnings"][0]
        assert found[2]["warnings"] == []
        assert torch.isfinite(found[3]["out"]).all()


@pytest.mark.slow
def test_wan22_expert_pair_under_ulysses_equals_one_process(ranks):
    for rank, found in enumerate(ranks):
        found = found["pair"]
        torch.testing.assert_close(found["ulysses"], found["single"], rtol=1e-5, atol=1e-6)
        assert (found["single"] - found["dense"]).abs().max() > 1e-3  # the plans changed the generation
        for name, heads in found["heads"].items():  # each expert runs this process's heads of its own plan
            per_gpu = found["plan_orders"][name].shape[1] // WORLD
            assert heads == (rank * per_gpu, (rank + 1) * per_gpu)
            assert torch.equal(found["head_orders"][name], found["plan_orders"][name][:, heads[0]:heads[1]])
    assert ranks[0]["pair"]["heads"].keys() == {"transformer", "transformer_2"}


@pytest.mark.slow
def test_fullgraph_compile_under_ulysses_equals_one_process_with_one_graph(ranks):
    for found in ranks:
        found = found["compiled"]
        for single, compiled, pipelined in zip(found["single"], found["compiled"], found["compiled_pipelined"],
                                               strict=True):
            torch.testing.assert_close(compiled, single, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pipelined, single, rtol=1e-5, atol=1e-5)
        assert found["graphs"] == 1  # both buckets, no recompile


@pytest.mark.slow
def test_ring_attention_is_refused_with_what_to_do(ranks):
    for found in ranks:
        assert "ring_degree=2" in found["ring"] and "ContextParallelConfig(ulysses_degree=2)" in found["ring"]


@pytest.mark.slow
def test_exchange_groups_that_do_not_divide_a_gpus_heads_are_refused_with_the_choices(ranks):
    for found in ranks:
        assert "exchange_groups=3" in found["groups"] and "2 heads" in found["groups"]
        assert "use one of 1, 2" in found["groups"]


@pytest.mark.slow
def test_lone_processor_must_be_bound_before_a_parallel_forward(ranks):
    for found in ranks:
        assert "paroattn.apply" in found["lone"] and "bind" in found["lone"]


@pytest.mark.slow
def test_generate_ulysses_writes_on_rank_0_only_and_equals_one_process(ranks):
    import numpy as np
    from PIL import Image

    first, second = ranks[0]["generate"], ranks[1]["generate"]
    assert second["result"] == {"rank": 1} and second["written"] == []
    assert first["result"]["ulysses"] == WORLD and first["written"] == [first["result"]["path"]]
    single = first["single"]
    assert "ulysses" not in single
    ulysses_pixels = torch.from_numpy(np.asarray(Image.open(first["result"]["path"]), dtype=np.float32))
    single_pixels = torch.from_numpy(np.asarray(Image.open(single["path"]), dtype=np.float32))
    assert (ulysses_pixels - single_pixels).abs().max() <= 1  # 8-bit rounding of equal images


@pytest.mark.slow
def test_generate_plan_auto_under_ulysses_learns_once_then_runs_the_plan_one_process_learns(ranks):
    import numpy as np
    from PIL import Image

    from paroattn import Plan

    first, second = ranks[0]["generate"], ranks[1]["generate"]
    assert second["auto"] == [{"rank": 1}, {"rank": 1}] and second["auto_written"] == []
    learnt, cached = first["auto"]
    assert (learnt["auto"], cached["auto"]) == ("learnt", "cached") and learnt["ulysses"] == cached["ulysses"] == WORLD
    assert "dense_s" in learnt and "paro_s" in cached and learnt["plan_path"] == cached["plan_path"]
    assert first["auto_written"] == [learnt["path"], cached["path"]]
    assert first["auto_entries"] == second["auto_entries"] == [Path(learnt["plan_path"]).name]  # no lock, no partial
    single = first["auto_single"]
    assert [r["auto"] for r in single] == ["learnt", "cached"]
    plan, single_plan = Plan.load(learnt["plan_path"]), Plan.load(single[0]["plan_path"])
    assert torch.equal(plan.orders, single_plan.orders) and torch.equal(plan.block_mask, single_plan.block_mask)

    def pixels(result):
        return torch.from_numpy(np.asarray(Image.open(result["path"]), dtype=np.float32))

    for ulysses_run, single_run in zip(first["auto"], single, strict=True):
        assert (pixels(ulysses_run) - pixels(single_run)).abs().max() <= 1  # 8-bit rounding of equal images


@pytest.mark.slow
def test_generate_ulysses_runs_cogvideox_and_its_own_attention_through_paro(ranks):
    pixels = ranks[0]["generate"]["cogvideox"]
    assert sorted(pixels) == ["cog_single.gif", "cog_single_dense.gif", "cog_ulysses.gif", "cog_ulysses_dense.gif"]
    for run in ("", "_dense"):
        torch.testing.assert_close(torch.as_tensor(pixels[f"cog_ulysses{run}.gif"]),
                                   torch.as_tensor(pixels[f"cog_single{run}.gif"]), rtol=1e-4, atol=1e-4)
    assert ranks[1]["generate"]["cogvideox"] == {}  # rank 0 writes
    assert "needs a plan: pass --plan PLAN" in ranks[0]["generate"]["no_plan"]


@pytest.mark.slow
def test_auto_plan_learnt_under_ulysses_is_the_one_process_plan_on_every_process(ranks):
    first, second = (found["auto"] for found in ranks)
    assert first["learnt"] and not second["learnt"]  # the first process wrote the entry, once
    assert first["heads"] == (0, HEADS // WORLD) and second["heads"] == (HEADS // WORLD, HEADS)
    for found in (first, second):
        assert len(found["entries"]) == 1 and found["entries"][0].endswith(".safetensors")  # no lock, no partial file
        # the learning generation is the model's own attention, under Ulysses as on one process
        torch.testing.assert_close(found["first"], found["dense"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(found["first"], found["single_dense"], rtol=1e-5, atol=1e-6)
        # the plan of every head, in order, as one process recording them all learns it
        plan, single = found["plan"], found["single_plan"]
        assert plan.num_heads == HEADS and len(set(plan.orders.flatten().tolist())) > 1
        assert torch.equal(plan.orders, single.orders) and torch.equal(plan.block_mask, single.block_mask)
        assert torch.equal(plan.orders, first["plan"].orders) and torch.equal(plan.block_mask, first["plan"].block_mask)
        # the next generation runs it, sparse, capturing nothing, as one process runs its own plan
        assert found["captured"] > 0 and found["captured_after"] == found["captured"]
        torch.testing.assert_close(found["second"], found["single_sparse"], rtol=1e-5, atol=1e-6)
        assert (found["second"] - found["dense"]).abs().max() > 1e-3
        torch.testing.assert_close(found["hit"], found["second"], rtol=1e-5, atol=1e-6)  # a fresh pipeline loads it
        assert not found["hit_learnt"]


@pytest.mark.slow
def test_auto_plan_learning_that_fails_on_one_process_under_ulysses_writes_nothing(ranks):
    first, second = (found["auto"] for found in ranks)
    assert second["failure"] == "ValueError: the second process failed"
    assert first["failure"].startswith("RuntimeError: plan='auto': process 1 of the Ulysses group failed")
    assert "nothing was written" in first["failure"]
    for found in (first, second):
        assert found["failed_entries"] == [] and found["failed_plan"] is None  # no plan, no partial file, no lock
        assert found["relearnt"]  # the lock was released: the next generation learns it


@pytest.mark.slow
def test_auto_plan_under_ulysses_runs_dense_on_every_process_while_another_learns_it(ranks):
    for rank, found in enumerate(ranks):
        found = found["auto"]
        torch.testing.assert_close(found["cog_waiting"], found["cog_dense"], rtol=1e-5, atol=1e-6)
        state = found["cog_waiting_state"]
        assert state["plan"] is None and state["captured"] == 0 and state["entries"] == [
            next(name for name in state["entries"] if name.endswith(".lock"))]  # the holder's lock alone
        assert ("another process is learning" in state["log"]) == (rank == 0)  # the first process says so


# -- refusals and pieces that need no process group ---------------------------------------------------------------


def test_head_slice_is_the_heads_of_the_plan():
    transformer = tiny_transformer("wan", heads=HEADS)
    plan = make_plan(transformer, tiny_forward_inputs(transformer))
    part = plan.head_slice(2, 4)
    assert part.num_heads == 2 and part.layout == plan.layout and part.block_size == plan.block_size
    assert torch.equal(part.orders, plan.orders[:, 2:4])
    assert torch.equal(part.block_mask, plan.block_mask[:, :, 2:4])
    assert torch.equal(part.density, plan.density[:, :, 2:4]) and torch.equal(part.dense, plan.dense)
    with pytest.raises(PlanError, match="not within the plan's 4 heads"):
        plan.head_slice(3, 5)


def _config(**degrees):
    return ParallelConfig(context_parallel_config=ContextParallelConfig(**degrees))


def test_head_count_the_degree_does_not_divide_is_refused():
    transformer = tiny_transformer("wan", heads=3)
    inputs = tiny_forward_inputs(transformer)
    plan = make_plan(transformer, inputs, heads=3)
    assert "divides 3 (3)" in ulysses_problem(plan.num_heads, 2)
    with apply(transformer, plan, backend="torch") as handle:
        with pytest.raises(PlanError, match=r"3 heads per layer are not divisible by ulysses_degree=2"):
            handle.processor._parallel_config = _config(ulysses_degree=2)  # what enable_parallelism does


def test_ring_is_refused_and_dense_on_mismatch_keeps_the_reason():
    transformer = tiny_transformer("wan", heads=HEADS)
    plan = make_plan(transformer, tiny_forward_inputs(transformer))
    with apply(transformer, plan, backend="torch") as handle:
        with pytest.raises(PlanError, match=r"ring_degree=2.*ulysses_degree=4"):
            handle.processor._parallel_config = _config(ring_degree=2, ulysses_degree=2)
    with apply(transformer, plan, backend="torch", on_mismatch="dense") as handle:
        handle.processor._parallel_config = _config(ring_degree=2)
        assert "ring_degree=2" in handle.processor.parallel_problem and handle.processor._ulysses is None


@pytest.mark.parametrize("family", ["cogvideox", "hunyuan_video", "hunyuan_video15", "skyreels_v2", "wan_vace"])
def test_families_without_a_plan_in_diffusers_get_one_from_their_adapter(family):
    transformer = tiny_transformer(family, heads=HEADS)
    assert type(transformer)._cp_plan is None  # diffusers 0.42.1 has none: the adapter's
    plan = context_parallel_plan(transformer)
    assert "proj_out" in plan and any(key.endswith(".0") for key in plan)
    assert context_parallel_plan(tiny_transformer("wan")) is type(tiny_transformer("wan"))._cp_plan  # diffusers' own


def test_transformers_whose_plan_does_not_hold_are_refused_even_with_dense_on_mismatch():
    from diffusers import HunyuanVideoTransformer3DModel

    from paroattn.pipelines.context_parallel import model_problem

    replacing = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=16, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16,
        pooled_projection_dim=16, rope_axes_dim=(4, 6, 6), image_condition_type="token_replace")
    plan = make_plan(replacing, tiny_forward_inputs(replacing))
    for on_mismatch in ("error", "dense"):  # the model's own attention cannot run under Ulysses either
        with apply(replacing, plan, backend="torch", on_mismatch=on_mismatch) as handle:
            with pytest.raises(PlanError, match="token_replace.*only the first GPU holds them"):
                handle.processor._parallel_config = _config(ulysses_degree=2)
    no_plan = SimpleNamespace(context_parallel_plan=lambda transformer: None)
    assert "has no context-parallel plan, in diffusers or in paroattn" in model_problem(replacing, no_plan)
    cogvideox = tiny_transformer("cogvideox", heads=HEADS)
    with apply(cogvideox, make_plan(cogvideox, tiny_forward_inputs(cogvideox)), backend="torch",
               on_mismatch="dense") as handle:
        with pytest.raises(PlanError, match="ring_degree=2.*CogVideoX attention cannot run under this config either"):
            handle.processor._parallel_config = _config(ring_degree=2)
    # the other way round: a config on the model (enable_parallelism first) reaches apply, which leaves it as it was
    originals = dict(replacing.attn_processors)
    replacing._parallel_config = _config(ulysses_degree=2)
    with pytest.raises(PlanError, match="token_replace"):
        apply(replacing, plan, backend="torch")
    assert all(replacing.attn_processors[key] is processor for key, processor in originals.items())


def test_calibration_capture_refuses_context_parallelism():
    transformer = tiny_transformer("wan")
    next(iter(transformer.attn_processors.values()))._parallel_config = _config(ulysses_degree=2)
    with pytest.raises(PlanError, match="calibrate on one GPU"):
        with capture_attention(transformer, lambda *args: None):
            pass


def test_sequence_the_degree_does_not_split_evenly_is_named():
    from paroattn import TokenLayout

    assert sequence_problem(TokenLayout(8, 1, 6, 6), 2) is None
    problem = sequence_problem(TokenLayout(8, 1, 5, 5), 2)
    assert "25 grid tokens" in problem and "ulysses_degree=2" in problem and "ulysses_anything=True" in problem
    assert sequence_problem(TokenLayout(8, 1, 5, 5), 2, uneven=True) is None
    # a text every GPU holds whole need not split: CogVideoX's 226 tokens under 4 GPUs
    assert sequence_problem(TokenLayout(226, 13, 30, 44), 4, "whole") is None
    assert "226 text tokens" in sequence_problem(TokenLayout(226, 13, 30, 44), 4)


def test_generate_ulysses_outside_torchrun_says_how_to_launch(tmp_path, monkeypatch):
    from paroattn.pipelines.context_parallel import join_process_group

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 2 --no-python paro generate"):
        join_process_group(2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        join_process_group(2)


def test_paro_generate_ulysses_outside_torchrun_fails_before_loading(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from paroattn.app.cli import app

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "model_index.json").write_text("{}")
    result = CliRunner().invoke(app, ["generate", str(tmp_path), "--prompt", "a cat", "--ulysses", "2",
                                      "--out", str(tmp_path / "out.png")])
    assert result.exit_code == 2
    assert "torchrun --nproc-per-node 2" in result.output and "loading" not in result.output


def test_paro_generate_exchange_groups_are_checked_before_loading(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from paroattn.app.cli import app

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "model_index.json").write_text("{}")
    transformer = tiny_transformer("wan", heads=HEADS)
    make_plan(transformer, tiny_forward_inputs(transformer)).save(tmp_path / "plan.safetensors")
    common = ["generate", str(tmp_path), "--prompt", "a cat", "--out", str(tmp_path / "out.png")]
    alone = CliRunner().invoke(app, [*common, "--plan", str(tmp_path / "plan.safetensors"), "--exchange-groups", "2"])
    assert alone.exit_code == 2 and "pass --ulysses N and --plan PLAN too" in alone.output
    # 4 heads over 2 GPUs: 2 each, which 3 groups do not split
    uneven = CliRunner().invoke(app, [*common, "--plan", str(tmp_path / "plan.safetensors"), "--ulysses", "2",
                                      "--exchange-groups", "3"])
    assert uneven.exit_code == 2 and "exchange_groups=3" in uneven.output and "use one of 1, 2" in uneven.output
    assert "loading" not in alone.output + uneven.output
