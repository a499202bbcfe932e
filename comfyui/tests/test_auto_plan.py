"""Apply PARO without a plan (plan 'auto') in ComfyUI graphs on the tiny Wan model: the first sampling run learns
the plan while it runs dense and caches it in paroattn's plan cache; later runs use it, whether the node runs again
(a new executor: it loads the cache entry) or its MODEL is reused (the same executor: the hook switches to the plan)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from model_chain import apply_paro, run_chained
from test_graphs import BLOCK, STEPS, WAN_LAYOUT, latent_of, plan_folder, run_graph

import paroattn
from paroattn.calibrate import StatsRecorder
from paroattn.runner.cache import EntryLock, entry_name

AUTO = {"density": 0.5, "block_size": BLOCK}


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """An empty plan cache ($PAROATTN_CACHE) for the test."""
    folder = tmp_path / "plan-cache"
    monkeypatch.setenv("PAROATTN_CACHE", str(folder))
    return folder


@pytest.fixture
def recorded(monkeypatch) -> list:
    """The layers of every self-attention call a StatsRecorder records (in any recorder of the process)."""
    calls = []
    record = StatsRecorder.record

    def spy(self, layer, *args, **kwargs):
        calls.append(layer)
        return record(self, layer, *args, **kwargs)

    monkeypatch.setattr(StatsRecorder, "record", spy)
    return calls


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_auto_learns_in_the_first_run_and_loads_the_cached_plan_in_the_next(wan, cache, recorded, caplog):
    import comfy_env

    caplog.set_level(logging.INFO)
    assert run_graph("wan", keep="auto-dense") == (True, "")
    ok, error, messages = run_chained([apply_paro(**AUTO)], keep="auto-first")
    assert (ok, error) == (True, "")
    assert "PARO learns: no cached plan" in comfy_env.node_text(messages, "node0")
    # the learning run is the dense model's, call for call
    assert torch.equal(latent_of("auto-first"), latent_of("auto-dense"))
    assert recorded and set(recorded) == {0, 1}
    # one entry, under the name paroattn.apply(pipe, "auto") gives the diffusers model with these weights
    name = entry_name(type(wan).__name__, wan.config, density=0.5, qk="bf16", pv="bf16", block_size=BLOCK)
    assert files(cache) == [name]
    plan = paroattn.Plan.load(cache / name)
    assert plan.layout == WAN_LAYOUT and plan.num_layers == 2 and plan.block_size == (BLOCK, BLOCK)
    assert plan.model_class == "WanTransformer3DModel" and 0.3 < plan.achieved_density() < 0.7
    assert sum(plan.info["steps_per_bucket"]) == STEPS  # a new timestep starts a new step (cond and uncond batched)
    # the buckets the run's steps missed are named, with how to learn them
    (learnt,) = [record.getMessage() for record in caplog.records if "learnt a plan" in record.getMessage()]
    empty = plan.info["steps_per_bucket"].count(0)
    assert empty and f"{empty} of its {plan.num_buckets} timestep buckets had no step in this sampling run" in learnt
    with paroattn.apply(wan, plan, backend="torch", on_mismatch="error"):  # the diffusers side accepts it
        pass

    # a new executor: Apply PARO finds the entry, and the run records nothing
    count = len(recorded)
    ok, error, messages = run_chained([apply_paro(**AUTO)], keep="auto-second")
    assert (ok, error) == (True, "")
    assert f"PARO on: cached plan {cache / name}" in comfy_env.node_text(messages, "node0")
    assert len(recorded) == count
    # the same as Apply PARO with that plan as a file, and not the dense model
    shutil.copy(cache / name, plan_folder() / "auto-learnt.safetensors")
    assert run_chained([apply_paro("auto-learnt.safetensors")], keep="auto-file")[:2] == (True, "")
    assert torch.equal(latent_of("auto-second"), latent_of("auto-file"))
    assert not torch.allclose(latent_of("auto-second"), latent_of("auto-dense"), atol=1e-3)


def test_auto_model_reused_by_one_executor_runs_the_plan_it_learnt(wan, cache, recorded):
    """Through one ComfyUI executor Apply PARO does not run again while its inputs stay the same: the MODEL it gave,
    which learnt the plan, runs it from its next sampling run on."""
    import comfy_env

    runner = comfy_env.executor()
    assert run_chained([apply_paro(**AUTO)], runner, keep="reused-first")[:2] == (True, "")
    count = len(recorded)
    assert count > 0 and len(files(cache)) == 1
    # the plan moves out of the cache: the MODEL holds it, and neither reads nor writes the cache again
    shutil.move(cache / files(cache)[0], plan_folder() / "reused-learnt.safetensors")
    ok, error, messages = run_chained([apply_paro(**AUTO)], runner, keep="reused-second", seed=8)
    assert (ok, error) == (True, "")
    assert any(event == "execution_cached" and "node0" in data["nodes"] for event, data in messages)
    assert len(recorded) == count and files(cache) == []  # the sampler ran again, the capture did not
    assert run_chained([apply_paro("reused-learnt.safetensors")], keep="reused-file", seed=8)[:2] == (True, "")
    assert torch.equal(latent_of("reused-second"), latent_of("reused-file"))


def test_auto_interrupted_run_writes_nothing_and_the_next_run_learns(wan, cache, recorded):
    ok, _, messages = run_chained([apply_paro(**AUTO), ("InterruptAfterCalls", {"calls": 3})], keep="interrupted")
    assert not ok and any(event == "execution_interrupted" for event, _ in messages)
    assert recorded  # it was learning when interrupted
    assert files(cache) == []  # no entry, no partial file, no lock left
    assert run_chained([apply_paro(**AUTO)], keep="after-interrupt")[:2] == (True, "")
    assert len(files(cache)) == 1


def test_auto_runs_dense_while_another_process_learns_the_plan(wan, cache, recorded):
    import comfy_env

    assert run_graph("wan", keep="locked-dense") == (True, "")
    family = comfy_env.pack_module("families").WanFamily
    name = entry_name(family.diffusers_class, wan.config, density=0.5, qk="bf16", pv="bf16", block_size=BLOCK)
    lock = EntryLock(cache / name)  # the lock another process's learning run would hold
    assert lock.acquire()
    try:
        assert run_chained([apply_paro(**AUTO)], keep="locked")[:2] == (True, "")
    finally:
        lock.release()
    assert torch.equal(latent_of("locked"), latent_of("locked-dense"))
    assert recorded == [] and files(cache) == []


def test_auto_loads_a_plan_another_process_wrote_while_this_one_took_the_lock(wan, cache, recorded, monkeypatch):
    assert run_chained([apply_paro(**AUTO)], keep="race-learner")[:2] == (True, "")
    (entry,) = [cache / name for name in files(cache)]
    written = entry.read_bytes()
    entry.unlink()
    count = len(recorded)
    take = EntryLock.acquire

    def finished_meanwhile(lock):  # the other process writes its plan and lets the lock go just before this one asks
        entry.write_bytes(written)
        return take(lock)

    monkeypatch.setattr(EntryLock, "acquire", finished_meanwhile)
    assert run_chained([apply_paro(**AUTO)], keep="race-loader")[:2] == (True, "")
    assert len(recorded) == count and entry.read_bytes() == written  # loaded, not learnt and written again
    assert not torch.equal(latent_of("race-loader"), latent_of("race-learner"))  # the loader ran sparse
