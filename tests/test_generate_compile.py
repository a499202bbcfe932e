"""`paro generate --compile`: each run's transformers compiled (blocks one by one, whole, or under CUDA graphs)
before it and restored after; the same pixels as the eager run; refusals before the model loads.

The compiled runs here go through dynamo's "aot_eager" backend (the same tracing, no code generation) so that
they take seconds on a CPU; inductor itself is tested in test_compile.py."""

from __future__ import annotations

import pytest
import torch
from test_cli_errors import assert_clean_failure
from test_offline_pipeline import PROMPT, invoke
from tiny_models import tiny_pipeline, tiny_transformer
from torch._dynamo.testing import CompileCounterWithBackend

import paroattn.app.generate as generation
from paroattn.app.demo import shipped_plan_path
from paroattn.app.options import compile_option_problem

SMALL = dict(height=16, width=16, frames=2, steps=2)  # 2 x 8 x 8 = 128 tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "demo-pipeline"
    result = invoke(["demo-pipeline", path])
    assert result.exit_code == 0, result.output
    return path


def test_compile_refusals_before_the_model_loads(tmp_path):
    def generate(*args):
        return invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", *args])

    assert_clean_failure(generate("--compile", "fast"), "--compile 'fast' is not one of blocks, whole, graphs")
    assert_clean_failure(generate("--compile", "graphs", "--device", "cpu"), "CUDA graphs", "this run is on the CPU",
                         "--compile blocks or whole")
    assert not (tmp_path / "no-model").exists()
    assert "--compile whole with --ulysses is not supported" in compile_option_problem("whole", "cuda", ulysses=2)
    assert compile_option_problem("graphs", "cuda") is None
    assert compile_option_problem(None, "cpu", ulysses=2) is None


@pytest.mark.parametrize(("family", "kinds"), [
    ("wan", {"WanTransformerBlock": 2}),
    ("flux", {"FluxTransformerBlock": 1, "FluxSingleTransformerBlock": 2}),
    ("cogvideox", {"CogVideoXBlock": 2}),  # names no repeated blocks: its transformer_blocks' class
])
def test_blocks_are_the_models_repeated_blocks(family, kinds):
    blocks = generation.repeated_blocks(tiny_transformer(family))
    assert {name: sum(type(b).__name__ == name for b in blocks) for name in kinds} == kinds
    assert len(blocks) == sum(kinds.values())
    with pytest.raises(ValueError, match="names no repeated blocks .* pass --compile whole"):
        generation.repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("how", ["blocks", "whole", "graphs"])
def test_every_expert_is_compiled_for_the_run_and_restored_after(how, monkeypatch):
    monkeypatch.setattr(generation, "COMPILE_BACKEND", "eager")
    options = []
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda module, **kwargs: options.append(kwargs) or compile_module(module, **kwargs))
    pipe = tiny_pipeline("wan2.2")
    experts = [pipe.transformer, pipe.transformer_2]
    compiled = [list(generation.repeated_blocks(t)) if how == "blocks" else [t] for t in experts]
    with generation.compiled(pipe, how):
        assert all(m._compiled_call_impl is not None for modules in compiled for m in modules)
        mode = {"mode": "reduce-overhead"} if how == "graphs" else {}
        assert options == [{"fullgraph": True, "backend": "eager", **mode}] * sum(map(len, compiled))
        others = [m for t in experts for m in t.modules() if not any(m is c for mods in compiled for c in mods)]
        assert all(getattr(m, "_compiled_call_impl", None) is None for m in others)
    assert all(m._compiled_call_impl is None for t in experts for m in t.modules())


@pytest.mark.parametrize("how", ["blocks", "whole"])
@pytest.mark.slow
def test_compiled_generation_equals_eager_with_one_graph_per_run(folder, tmp_path, monkeypatch, how):
    """PARO against dense, eager and compiled: the same pixels; one graph per run (the dense run's and the PARO
    run's: the caches are reset between them), of one block or of the whole transformer (its patch embedding)."""
    written = {}

    def keep(pixels, path, video, fps):
        written[path.name] = pixels
        return path

    monkeypatch.setattr(generation, "_write", keep)
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(generation, "COMPILE_BACKEND", counter)
    options = dict(plan=shipped_plan_path(0.5), compare=True, device="cpu", log=lambda message: None, **SMALL)
    eager = generation.generate(folder, PROMPT, out=tmp_path / "eager.gif", **options)
    compiled = generation.generate(folder, PROMPT, out=tmp_path / "compiled.gif", compile_mode=how, **options)
    assert compiled["compile"] == how and "compile" not in eager
    for run in ("", "_dense"):
        torch.testing.assert_close(torch.from_numpy(written[f"compiled{run}.gif"]),
                                   torch.from_numpy(written[f"eager{run}.gif"]), rtol=0, atol=2e-3)
    assert counter.frame_count == 2
    whole = ["conv3d" in str(graph.code) or "convolution" in str(graph.code) for graph in counter.graphs]
    assert whole == [how == "whole"] * 2


@pytest.mark.slow
def test_the_command_says_its_times_include_compiling(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(generation, "COMPILE_BACKEND", "aot_eager")
    result = invoke(["generate", folder, "--prompt", PROMPT, "--steps", "1", "--height", "16", "--width", "16",
                     "--frames", "2", "--device", "cpu", "--compile", "blocks", "--out", tmp_path / "x.gif"])
    assert result.exit_code == 0, result.output
    assert "compiling the transformer (blocks) at each run's first step" in result.output
    # the progress bar's carriage returns share a line with the report
    assert "dense: " in result.output and "s (compiled: blocks, compiling included) -> " in result.output
