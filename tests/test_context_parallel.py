"""PARO under diffusers' context parallelism (Ulysses), on CPU: two processes joined with gloo run tiny Wan, FLUX.1,
FLUX.2, Qwen-Image, LTX-Video and LTX-2 transformers with `enable_parallelism(ContextParallelConfig(ulysses_degree=2))` and
must give what one process gives with the same plan, each running its own slice of the plan's heads, and so must a
tiny Wan 2.2 expert pair generating with a plan per expert, a per-token timestep that diffusers splits with the sequence (every GPU picks one process's
bucket), and PARO under `torch.compile(fullgraph=True)`; ring attention, head counts the degree does not
divide, models without a context-parallel plan (CogVideoX, HunyuanVideo 1 and 1.5, SkyReels-V2, Wan VACE), calibration
capture and frame binding are refused with what to do.

diffusers places each process on accelerator `rank % torch.accelerator.device_count()`, which is 0 on CPU: the
workers patch it to 1 and pass a CPU device mesh. One spawn runs every distributed case (the imports dominate)."""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path

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
from paroattn.pipelines.context_parallel import sequence_problem, ulysses_problem
from paroattn.plan import model_fingerprint

WORLD = 2
HEADS = 4  # two per process: each holds a contiguous slice of more than one head
TIMESTEPS = (800.0, 200.0)  # one per bucket of the two-bucket plans
JOIN_TIMEOUT_S = 240
PAIR_LAYOUT = TokenLayout(0, 3, 4, 4)  # tiny_pipeline("wan2.2") at tiny_call_kwargs' size: 9 frames of 64 x 64
PAIR_STEPS = 4  # two on each expert
# the families whose diffusers context-parallel plan PARO follows (text and grid split in equal chunks)
ULYSSES_FAMILIES = ("wan", "flux", "flux2", "qwen_image", "ltx", "ltx2")


def make_plan(transformer, inputs, *, seed=3, heads=HEADS) -> Plan:
    """Random orders and masks at density 0.5: every head differs from every other."""
    return Plan.synthetic(
        layout=family_of(transformer).call_inputs(transformer, inputs).layout,
        num_layers=len(self_attention_layers(transformer)), num_heads=heads, density=0.5, orders="random",
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


def _one_process_then_ulysses(transformer, calls) -> tuple[Plan, list]:
    """A plan for `transformer` and its outputs on `calls` with PARO on this process alone; then the transformer
    is put under Ulysses 2 (`enable_parallelism`)."""
    plan = make_plan(transformer, calls[0])
    with apply(transformer, plan, backend="torch"):
        single = [run(transformer, inputs) for inputs in calls]
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD, mesh=_mesh((1, WORLD))))
    return plan, single


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
    plan, single = _one_process_then_ulysses(transformer, calls)
    found = {"plan_orders": plan.orders.clone(), "mask_blocks": plan.mask_blocks, "single": single}
    with apply(transformer, plan, backend="torch") as handle:  # after enable_parallelism: copied from the original
        found["after"] = [run(transformer, inputs) for inputs in calls]
        processor = handle.processor
        found["heads"] = processor._ulysses.heads
        found["head_orders"] = processor.head_plan.orders.clone()
        found["mask_heads"] = {tuple(handle.binding.masks.get(b, 0).shape) for b in range(plan.num_buckets)}
        from paroattn.pipelines.prefetch import MaskStore

        found["list_bytes"] = (MaskStore(processor.head_plan, "cpu", lists=True).host_bytes,
                               MaskStore(plan, "cpu", lists=True).host_bytes)
    with apply(transformer, plan, backend="torch", fuse_rope=False):  # the model's own RoPE before the exchange
        found["unfused_rope"] = [run(transformer, inputs) for inputs in calls]

    before = tiny_transformer(family, heads=HEADS)  # enable_parallelism cannot be called twice on one model
    with apply(before, plan, backend="torch"):  # before enable_parallelism: diffusers sets the processor's config
        before.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD, mesh=_mesh((1, WORLD))))
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
        expert.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD, mesh=_mesh((1, WORLD))))
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
    from paroattn.pipelines import generate as generate_module

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
    return found


def _worker(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.accelerator.device_count = lambda: 1  # 0 on CPU, which diffusers divides by
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    folder = Path(folder)
    results = {family: _ulysses_family(family, rank) for family in ULYSSES_FAMILIES}
    results.update({"pair": _expert_pair(rank),
               "per_token": _per_token_timesteps(rank),
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
    context = mp.start_processes(_worker, args=(_free_port(), str(folder)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:  # a collective that one process never reached
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD} processes did not finish within {JOIN_TIMEOUT_S} s")
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("family", ULYSSES_FAMILIES)
@pytest.mark.parametrize("order", ["after", "before", "unfused_rope"])
def test_paro_under_ulysses_equals_one_process(ranks, family, order):
    for found in ranks:
        for single, parallel in zip(found[family]["single"], found[family][order]):
            assert parallel.shape == single.shape
            torch.testing.assert_close(parallel, single, rtol=1e-5, atol=1e-6)
    # and the buckets differ, so both were exercised
    assert not torch.allclose(ranks[0][family]["single"][0], ranks[0][family]["single"][1])


@pytest.mark.parametrize("family", ULYSSES_FAMILIES)
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


def test_per_token_timesteps_bucket_every_gpu_as_one_process(ranks):
    for found in ranks:
        found = found["per_token"]
        for single, parallel in zip(found["single"], found["ulysses"], strict=True):
            torch.testing.assert_close(parallel, single, rtol=1e-5, atol=1e-6)


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


def test_fullgraph_compile_under_ulysses_equals_one_process_with_one_graph(ranks):
    for found in ranks:
        found = found["compiled"]
        for single, compiled in zip(found["single"], found["compiled"], strict=True):
            torch.testing.assert_close(compiled, single, rtol=1e-5, atol=1e-5)
        assert found["graphs"] == 1  # both buckets, no recompile


def test_ring_attention_is_refused_with_what_to_do(ranks):
    for found in ranks:
        assert "ring_degree=2" in found["ring"] and "ContextParallelConfig(ulysses_degree=2)" in found["ring"]


def test_lone_processor_must_be_bound_before_a_parallel_forward(ranks):
    for found in ranks:
        assert "paroattn.apply" in found["lone"] and "bind" in found["lone"]


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
def test_models_without_a_context_parallel_plan_are_refused(family):
    transformer = tiny_transformer(family, heads=HEADS)
    plan = make_plan(transformer, tiny_forward_inputs(transformer))
    with apply(transformer, plan, backend="torch") as handle:
        with pytest.raises(PlanError, match=f"{type(transformer).__name__} has no context-parallel plan in diffusers"):
            handle.processor._parallel_config = _config(ulysses_degree=2)
    # the other way round: a config on the processor it replaces reaches apply, which leaves the model as it was
    originals = dict(transformer.attn_processors)
    originals[self_attention_layers(transformer)[0]]._parallel_config = _config(ulysses_degree=2)  # not a refiner's
    with pytest.raises(PlanError, match="run one pipeline per GPU"):
        apply(transformer, plan, backend="torch")
    assert all(transformer.attn_processors[key] is processor for key, processor in originals.items())


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
    assert "25 grid tokens" in problem and "ulysses_degree=2" in problem


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

    from paroattn.cli import app

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "model_index.json").write_text("{}")
    result = CliRunner().invoke(app, ["generate", str(tmp_path), "--prompt", "a cat", "--ulysses", "2",
                                      "--out", str(tmp_path / "out.png")])
    assert result.exit_code == 2
    assert "torchrun --nproc-per-node 2" in result.output and "loading" not in result.output
