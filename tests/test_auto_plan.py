"""`apply(pipe, "auto", density=...)`: the first generation runs dense and learns a plan into the cache, the next
ones run it; the cache's keys, its atomic writes, its lock between processes, and what it does with a corrupt or
interrupted entry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_call_kwargs, tiny_pipeline, tiny_transformer

import paroattn
from paroattn import Plan
from paroattn.calibrate.auto import buckets_without_steps
from paroattn.calibrate.recorder import StatsRecorder
from paroattn.pipelines import apply as apply_plan
from paroattn.runner.cache import EntryLock, cache_folder, clear_cache, entry_name, load_entry, write_entry

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {"density": 0.5, "block_size": 16}


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("wan")


def generate(pipe, **extra):
    with torch.no_grad():
        return pipe("a red ball", generator=torch.Generator().manual_seed(0), **{**tiny_call_kwargs("wan"), **extra}
                    ).frames


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".safetensors"))


def test_a_miss_learns_during_the_first_generation_and_the_next_runs_the_cached_plan(pipe, tmp_path, monkeypatch):
    dense = generate(pipe)
    lines = []
    handle = paroattn.apply(pipe, "auto", cache=tmp_path, log=lines.append, **OPTIONS)
    assert "no cached plan" in lines[0] and "runs dense" in lines[0] and str(handle.path) in lines[0]
    assert handle.plan is None and not handle.path.exists()
    first = generate(pipe)
    assert handle.captured > 0 and handle.learnt and handle.path.is_file()
    torch.testing.assert_close(first, dense, rtol=0, atol=0)  # the capture is the model's own attention
    assert "cached it at" in lines[-1]
    assert set(handle.timings) == {"generation_s", "stats_s", "plan_s", "write_s", "apply_s"}
    assert 0 < handle.timings["stats_s"] < handle.timings["generation_s"]
    plan = Plan.load(handle.path)
    assert (plan.block_size, plan.qk, plan.pv) == ((16, 16), "bf16", "bf16")
    # a new timestep starts a new step: the generation's 2 steps (two CFG calls each) weigh the buckets
    assert sum(plan.info["steps_per_bucket"]) == tiny_call_kwargs("wan")["num_inference_steps"]
    # 2 steps leave buckets without one: the message says so, and how to learn them
    empty = plan.info["steps_per_bucket"].count(0)
    assert empty and f"{empty} of its {plan.num_buckets} timestep buckets had no step in this generation" in lines[-1]
    assert f"remove {handle.path}" in lines[-1]

    def no_capture(*args, **kwargs):
        raise AssertionError("a generation with a cached plan captured statistics")

    monkeypatch.setattr(StatsRecorder, "record", no_capture)
    second = generate(pipe)  # the same handle, now sparse
    handle.remove()
    assert type(pipe).__call__ is type(pipe).__mro__[0].__call__ and "paroattn" not in type(pipe).__module__
    with apply_plan(pipe, Plan.load(handle.path)):
        by_hand = generate(pipe)
    torch.testing.assert_close(second, by_hand, rtol=0, atol=0)
    assert not torch.equal(second, dense)

    # another apply (as another process would) loads the entry and never captures
    lines.clear()
    with paroattn.apply(pipe, "auto", cache=tmp_path, log=lines.append, **OPTIONS) as again:
        assert lines == [f"paroattn: cached plan {again.path}"] and again.plan is not None
        third = generate(pipe)
    assert again.captured == 0 and not again.learnt
    torch.testing.assert_close(third, by_hand, rtol=0, atol=0)
    assert leftovers(tmp_path) == []


def test_a_plan_written_by_another_process_while_taking_the_lock_is_loaded_not_learnt_again(pipe, tmp_path,
                                                                                             monkeypatch):
    with paroattn.apply(pipe, "auto", cache=tmp_path, log=lambda line: None, **OPTIONS) as learner:
        generate(pipe)
    written = learner.path.read_bytes()
    learner.path.unlink()
    handle = paroattn.apply(pipe, "auto", cache=tmp_path, log=lambda line: None, **OPTIONS)
    take = EntryLock.acquire

    def finished_meanwhile(lock):  # the other process writes its plan and lets the lock go just before this one asks
        learner.path.write_bytes(written)
        return take(lock)

    monkeypatch.setattr(EntryLock, "acquire", finished_meanwhile)
    monkeypatch.setattr(StatsRecorder, "record", lambda *args, **kwargs: pytest.fail("learnt a plan that exists"))
    generate(pipe)
    assert handle.plan is not None and not handle.learnt and handle.path.read_bytes() == written
    handle.remove()


def test_an_interrupted_first_generation_leaves_no_plan(pipe, tmp_path):
    handle = paroattn.apply(pipe, "auto", cache=tmp_path, log=lambda _: None, **OPTIONS)

    def interrupt(pipeline, step, timestep, kwargs):
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            generate(pipe, callback_on_step_end=interrupt)
        assert handle.plan is None and list(tmp_path.iterdir()) == []  # no plan, no partial file, no lock
        assert all(not type(p).__name__.startswith("Capture") for p in pipe.transformer.attn_processors.values())
        generate(pipe)  # the next generation learns it
        assert handle.learnt and Plan.load(handle.path).num_layers == 2
    finally:
        handle.remove()


def test_a_corrupt_entry_is_removed_and_learnt_again(pipe, tmp_path):
    name = entry_name("WanTransformer3DModel", pipe.transformer.config, density=0.5, qk="bf16", pv="bf16",
                      block_size=16)
    good = tmp_path / "good"
    with paroattn.apply(pipe, "auto", cache=good, log=lambda _: None, **OPTIONS) as first:
        generate(pipe)
    data = first.path.read_bytes()
    assert first.path.name == name
    for broken in (data[: len(data) // 2], data[:-8] + bytes(b ^ 0xFF for b in data[-8:]), b"not a plan"):
        folder = tmp_path / str(len(broken))
        folder.mkdir()
        (folder / name).write_bytes(broken)
        lines = []
        with paroattn.apply(pipe, "auto", cache=folder, log=lines.append, **OPTIONS) as handle:
            assert handle.plan is None and "removed the unusable cached plan" in lines[0] and "no cached plan" in lines[1]
            generate(pipe)
            assert handle.learnt
        Plan.load(folder / name)


def test_a_plan_of_another_model_under_the_entry_name_is_not_used(pipe, tmp_path):
    with paroattn.apply(pipe, "auto", cache=tmp_path, log=lambda _: None, **OPTIONS) as handle:
        generate(pipe)
    lines = []
    assert load_entry(handle.path, fingerprint="0" * 16, log=lines.append) is None
    assert not handle.path.exists() and "fingerprint" in lines[0]


def test_the_key_changes_with_density_modes_block_sizes_and_model():
    config = dict(tiny_transformer("wan").config)
    base = {"density": 0.3, "qk": "bf16", "pv": "bf16", "block_size": 64}
    names = {entry_name("WanTransformer3DModel", config, **base)}
    for change in ({"density": 0.2}, {"qk": "int8"}, {"pv": "fp8"}, {"block_size": 128}, {"query_block": 128}):
        names.add(entry_name("WanTransformer3DModel", config, **{**base, **change}))
    names.add(entry_name("WanTransformer3DModel", {**config, "num_layers": 3}, **base))
    names.add(entry_name("CogVideoXTransformer3DModel", config, **base))
    names.add(entry_name("WanTransformer3DModel", config, **base, expert="transformer_2"))  # ComfyUI's second expert
    assert len(names) == 9
    with pytest.raises(ValueError, match="density"):
        entry_name("WanTransformer3DModel", config, **{**base, "density": 1.5})
    with pytest.raises(ValueError, match="qk"):
        entry_name("WanTransformer3DModel", config, **{**base, "qk": "int2"})


def test_the_learning_message_names_buckets_without_steps_only_when_there_are_some(tmp_path):
    plan = Plan.synthetic(layout=paroattn.TokenLayout(0, 2, 4, 4), num_layers=1, num_heads=2, density=0.5,
                          block_size=16)
    plan.info["steps_per_bucket"] = [3, 2]
    assert buckets_without_steps(plan, tmp_path / "x") == ""
    plan.info["steps_per_bucket"] = [3, 0]
    note = buckets_without_steps(plan, tmp_path / "x", "sampling run")
    assert "1 of its 2 timestep buckets had no step in this sampling run (3 steps)" in note
    assert f"remove {tmp_path / 'x'}" in note


def test_the_cache_folder_and_clearing_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path / "c"))
    assert cache_folder() == tmp_path / "c"
    monkeypatch.delenv("PAROATTN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert cache_folder() == tmp_path / "xdg" / "paroattn"
    plan = Plan.synthetic(layout=paroattn.TokenLayout(0, 2, 4, 4), num_layers=1, num_heads=2, density=0.5,
                          block_size=16)
    path = write_entry(plan, tmp_path / "xdg" / "paroattn" / "x.safetensors")
    (path.parent / ".x.safetensors.123.partial").write_bytes(b"half")
    assert paroattn.clear_cache() == 2 and list(path.parent.iterdir()) == []
    assert clear_cache(tmp_path / "missing") == 0


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    plan = Plan.synthetic(layout=paroattn.TokenLayout(0, 2, 4, 4), num_layers=1, num_heads=2, density=0.5,
                          block_size=16)

    def half(self, path):
        Path(path).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(Plan, "save", half)
    with pytest.raises(OSError, match="disk full"):
        write_entry(plan, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="advisory locks (flock)")
def test_a_lock_whose_file_was_released_and_removed_while_opening_it_is_not_taken(tmp_path, monkeypatch):
    """A process that opens the lock file just before its holder releases it (the file removed) must not take a lock
    on the removed file: a third process would lock a new file of the same name, and both would learn."""
    path = tmp_path / "x.safetensors"
    holder, late = EntryLock(path), EntryLock(path)
    assert holder.acquire()
    real_open = os.open

    def open_then_release(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        holder.release()  # between the late process's open and its flock
        return fd

    monkeypatch.setattr(os, "open", open_then_release)
    assert not late.acquire() and not late.held
    monkeypatch.setattr(os, "open", real_open)
    third = EntryLock(path)
    assert third.acquire() and third.held  # the entry's lock is free for the next process
    third.release()


HOLD_LOCK = """
import sys
from paroattn.runner.cache import EntryLock
lock = EntryLock(sys.argv[1])
assert lock.acquire()
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_generation_runs_dense_while_another_process_learns_the_plan(pipe, tmp_path):
    lines = []
    with paroattn.apply(pipe, "auto", cache=tmp_path, log=lines.append, **OPTIONS) as handle:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(handle.path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert holder.stdout.readline().strip() == "held"
            assert not EntryLock(handle.path).acquire()
            dense = generate(pipe)
            assert handle.captured == 0 and not handle.path.exists() and "another process" in lines[-1]
        finally:
            holder.kill()  # a dead holder's lock is released by the system
            holder.wait()
        generate(pipe)
        assert handle.learnt and handle.path.is_file()
        assert not torch.equal(generate(pipe), dense)


RACE = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
import torch
import paroattn
from tiny_models import tiny_call_kwargs, tiny_pipeline
pipe = tiny_pipeline("wan")
handle = paroattn.apply(pipe, "auto", density=0.5, block_size=16, cache=sys.argv[1], log=lambda _: None)
open(sys.argv[3], "w").close()
while not all(__import__("os").path.exists(p) for p in sys.argv[4:]):
    time.sleep(0.05)
def slow(pipeline, step, timestep, kwargs):
    time.sleep(2.0)  # the learning generation lasts long enough for the other process to find the lock
    return {}
pipe("a red ball", generator=torch.Generator().manual_seed(0), callback_on_step_end=slow, **tiny_call_kwargs("wan"))
print(json.dumps({"learnt": handle.learnt, "captured": handle.captured, "sparse": handle.plan is not None}))
"""


@pytest.mark.slow
def test_two_processes_learning_one_plan_write_it_once(tmp_path):
    cache = tmp_path / "cache"
    ready = [tmp_path / "ready0", tmp_path / "ready1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(cache), str(ROOT / "tests"), str(ready[i]),
                               *map(str, ready)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(__import__("json").loads(out.strip().splitlines()[-1]))
    assert sorted(r["learnt"] for r in results) == [False, True]
    other = next(r for r in results if not r["learnt"])
    assert other["captured"] == 0  # it ran dense (or, had it started late, loaded the plan): it never captured
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [
        p.name for p in cache.iterdir() if p.suffix == ".safetensors"]
    assert len(list(cache.glob("*.safetensors"))) == 1 and leftovers(cache) == []
    Plan.load(next(cache.glob("*.safetensors")))


def test_what_auto_refuses(pipe, tmp_path):
    with pytest.raises(TypeError, match="needs the pipeline"):
        paroattn.apply(pipe.transformer, "auto", cache=tmp_path)
    pair = tiny_pipeline("wan2.2")
    with pytest.raises(ValueError, match="expert pair.*load_plans"):
        paroattn.apply(pair, "auto", cache=tmp_path)
    with pytest.raises(TypeError, match="paroattn.apply\\(pipe, 'auto'"):
        apply_plan(pipe, "auto")
    plan = Plan.synthetic(layout=paroattn.TokenLayout(0, 3, 4, 4), num_layers=2, num_heads=2, density=0.5,
                          block_size=16)
    with pytest.raises(TypeError, match="density.*plan='auto'"):
        paroattn.apply(pipe, plan, density=0.3)
    with pytest.raises(ValueError, match="backend"):
        paroattn.apply(pipe, "auto", backend="nope", cache=tmp_path)
    with pytest.raises(ValueError, match="density"):
        paroattn.apply(pipe, "auto", density=0.0, cache=tmp_path)
    assert list(tmp_path.iterdir()) == [] and "paroattn" not in type(pipe).__module__


def test_auto_under_torch_compile_once_the_plan_exists(pipe, tmp_path):
    with paroattn.apply(pipe, "auto", cache=tmp_path, log=lambda _: None, **OPTIONS):
        generate(pipe)
    transformer = pipe.transformer
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 4, 3, 8, 8, generator=g), "timestep": torch.tensor([700.0]),
              "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
              "return_dict": False}
    with paroattn.apply(pipe, "auto", cache=tmp_path, log=lambda _: None, backend="torch", **OPTIONS) as handle:
        assert handle.plan is not None
        with torch.no_grad():
            eager = transformer(**inputs)[0]
            compiled = torch.compile(transformer, fullgraph=True, backend="aot_eager")(**inputs)[0]
    torch.testing.assert_close(compiled, eager)
    with torch.no_grad():
        assert not torch.equal(transformer(**inputs)[0], eager)  # removed: the model's own attention again


def test_auto_switches_a_learning_handle_for_a_later_apply(pipe, tmp_path):
    first = paroattn.apply(pipe, "auto", cache=tmp_path / "a", log=lambda _: None, **OPTIONS)
    own = type(pipe).__mro__[1]
    second = paroattn.apply(pipe, "auto", cache=tmp_path / "b", log=lambda _: None, **OPTIONS)
    generate(pipe)
    assert second.learnt and not first.learnt and not (tmp_path / "a").exists()
    first.remove()  # replaced: does not touch the pipeline
    assert type(pipe) is not own
    second.remove()
    assert type(pipe) is own



def test_paro_generate_plan_auto_learns_then_runs_the_cached_plan(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from paroattn.app.cli import app

    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path / "cache"))
    tiny_pipeline("wan").save_pretrained(tmp_path / "model")
    kwargs = tiny_call_kwargs("wan")
    size = ["--height", kwargs["height"], "--width", kwargs["width"], "--frames", kwargs["num_frames"], "--steps", 2]

    def paro(*args):
        return CliRunner().invoke(app, ["generate", str(tmp_path / "model"), "--prompt", "a cat runs", *map(str, size),
                                        *map(str, args)])

    first = paro("--plan", "auto", "--density", 0.5, "--out", tmp_path / "first.gif")
    assert first.exit_code == 0, first.output
    assert "no cached plan" in first.output and "cached it at" in first.output and "dense:" in first.output
    [entry] = (tmp_path / "cache").glob("*.safetensors")
    assert "_d0.5_" in entry.name and Plan.load(entry).achieved_density() > 0
    second = paro("--plan", "auto", "--density", 0.5, "--compare", "--out", tmp_path / "second.gif")
    assert second.exit_code == 0, second.output
    assert f"cached plan {entry}" in second.output and "PARO vs dense" in second.output
    # a miss with --compare: the dense run learns, the PARO run uses what it learnt
    third = paro("--plan", "auto", "--density", 0.3, "--compare", "--out", tmp_path / "third.gif")
    assert third.exit_code == 0, third.output
    assert "no cached plan" in third.output and "PARO vs dense" in third.output
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2
    refused = paro("--density", 0.5, "--out", tmp_path / "x.gif")
    assert refused.exit_code != 0 and "--plan auto" in refused.output
    refused = paro("--plan", "auto", "--qk", "int3", "--out", tmp_path / "x.gif")
    assert refused.exit_code != 0 and "--qk" in refused.output
    for flag in (["--compare"], ["--compile", "blocks"]):  # under Ulysses, one generation that learns or runs the plan
        refused = paro("--plan", "auto", "--ulysses", 2, *flag, "--out", tmp_path / "x.gif")
        assert refused.exit_code != 0 and f"{flag[0]}" in refused.output and "needs the plan first" in refused.output


def test_a_miss_under_a_parallel_config_paro_cannot_run_under_is_refused_before_anything_runs(tmp_path):
    import types

    pipe = tiny_pipeline("wan")  # (learning under Ulysses itself: tests/test_context_parallel.py, two processes)
    ring = types.SimpleNamespace(ulysses_degree=1, ring_degree=2, _ulysses_mesh=None)
    pipe.transformer._parallel_config = types.SimpleNamespace(context_parallel_config=ring)  # as enable_parallelism
    with paroattn.apply(pipe, "auto", cache=tmp_path, log=lambda _: None, **OPTIONS) as handle:
        with pytest.raises(paroattn.PlanError, match="plan='auto' under context parallelism.*ring_degree=2"):
            generate(pipe)
        assert handle.plan is None and handle.captured == 0 and list(tmp_path.iterdir()) == []


def test_the_learnt_statistics_are_freed_before_the_plan_is_written(pipe, tmp_path, monkeypatch):
    """The capture's accumulators (GBs at real sizes) go as soon as the plan is built, not when the garbage collector
    next runs: a binding's forward tracker calls back into the binding, a cycle that held the capture processor and
    the recorder behind it."""
    import gc
    import weakref

    import paroattn.calibrate.auto as auto
    from paroattn.calibrate.accumulate import StatsAccumulator

    made, alive_at_write = [], []
    init = StatsAccumulator.__init__

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    def write(plan, path):
        alive_at_write.append(sum(ref() is not None for ref in made))
        return write_entry(plan, path)

    monkeypatch.setattr(StatsAccumulator, "__init__", recorded_init)
    monkeypatch.setattr(auto, "write_entry", write)
    gc.disable()
    try:
        handle = paroattn.apply(pipe, "auto", cache=tmp_path, **OPTIONS)
        generate(pipe)
    finally:
        gc.enable()
        handle.remove()
    assert handle.learnt and made and alive_at_write == [0]
