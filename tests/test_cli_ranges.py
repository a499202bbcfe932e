"""Every numeric option of every `paro` command has a range that can run, checked before anything loads: a value
past it (a slip of the keyboard such as --steps 1000000000000) ends in one line naming the option and exit 2,
not in the pipeline. And no option is silently ignored: `inspect --heads` without `--png` is refused."""

from __future__ import annotations

import pytest
import typer
from test_cli_errors import assert_clean_failure, invoke, saved_tiny_flux

from paroattn.app.cli import app

HUGE_INT, HUGE_FLOAT = 10**30, 1e30


def numeric_options() -> list[tuple[str, str, str]]:
    """(command, flag, value) for every option of a number type, with a value past any range."""
    found = []
    for name, command in typer.main.get_command(app).commands.items():
        for param in command.params:
            if param.param_type_name != "option" or param.is_flag:
                continue
            # click parameters name their type; the installed typer's keep the annotation instead
            kind = getattr(getattr(param, "type", None), "name", None) or {int: "integer", float: "float"}.get(
                getattr(getattr(param, "type_descriptor", None), "annotation", None))
            if kind in ("integer", "float"):
                found.append((name, param.opts[0], str(HUGE_INT if kind == "integer" else HUGE_FLOAT)))
    return found


def no_model_loads(monkeypatch):
    import paroattn.app.generate as generate
    import paroattn.demo_model.model as demo_model

    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(demo_model, "load_demo_pipeline", lambda *a, **k: pytest.fail("loaded the demo model"))


def test_the_commands_have_numeric_options():
    flags = {(command, flag) for command, flag, _ in numeric_options()}
    assert {("demo", "--steps"), ("generate", "--steps"), ("calibrate", "--steps"), ("generate", "--ulysses"),
            ("calibrate", "--buckets"), ("bench", "--block-q")} <= flags


@pytest.mark.parametrize("command, flag, value", numeric_options())
def test_a_number_past_any_range_is_one_line_before_loading(tmp_path, monkeypatch, command, flag, value):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    base = {"calibrate": [tmp_path / "model", "--out", tmp_path / "new" / "p.safetensors"],
            "generate": [tmp_path / "model", "--prompt", "a cat", "--out", tmp_path / "new" / "x.png"],
            "demo": ["--out-dir", tmp_path / "new"], "bench": []}[command]
    result = invoke([command, *base, flag, value])
    assert_clean_failure(result, flag)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args, fragments", [
    (["demo", "--steps", "1000000000000"], ["--steps 1000000000000", "from 1 to 1000"]),
    (["demo", "--steps", "1001"], ["--steps 1001", "from 1 to 1000"]),
    (["generate", "MODEL", "--prompt", "a cat", "--steps", "1000000000000"], ["--steps", "from 1 to 1000"]),
    (["generate", "MODEL", "--prompt", "a cat", "--height", "100000"], ["--height 100000", "from 1 to 8192"]),
    (["generate", "MODEL", "--prompt", "a cat", "--ulysses", "100000"], ["--ulysses 100000", "GPUs from 1 to"]),
    (["generate", "MODEL", "--prompt", "a cat", "--exchange-groups", "100000"], ["--exchange-groups 100000"]),
    (["calibrate", "MODEL", "--out", "OUT", "--steps", "1000000000000"], ["--steps", "from 1 to 1000"]),
    (["calibrate", "MODEL", "--out", "OUT", "--num-prompts", "1000000000"], ["--num-prompts", "from 1 to 1000"]),
    (["calibrate", "MODEL", "--out", "OUT", "--buckets", "1000000000"], ["--buckets", "from 1 to 100"]),
    (["calibrate", "MODEL", "--out", "OUT", "--stat-every", "1000000000"], ["--stat-every"]),
    (["calibrate", "MODEL", "--out", "OUT", "--block-size", str(2**40)], ["--block-size", "from 16 to 1024"]),
    (["calibrate", "MODEL", "--out", "OUT", "--query-block", str(2**40)], ["--query-block", "up to 1024"]),
    (["calibrate", "MODEL", "--out", "OUT", "--dilation", "1000000000"], ["--dilation", "from 0 to 1024"]),
    (["calibrate", "MODEL", "--out", "OUT", "--ulysses", "1000000000"], ["--ulysses", "from 1 to 1024"]),
    (["calibrate", "MODEL", "--out", "OUT", "--quant-weight", "1e300"], ["--quant-weight", "from 0 to 1000"]),
    (["calibrate", "MODEL", "--out", "OUT", "--sizes", "100000x100000x9"], ["--sizes", "up to 8192 pixels"]),
    (["calibrate", "MODEL", "--out", "OUT", "--sizes", "64x64x100000"], ["--sizes", "up to 1024 frames"]),
])
def test_named_numbers_past_their_range(tmp_path, monkeypatch, args, fragments):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    swap = {"MODEL": tmp_path / "model", "OUT": tmp_path / "new.safetensors"}
    result = invoke([swap.get(a, a) for a in args] + (["--out-dir", tmp_path / "d"] if args[0] == "demo" else []))
    assert_clean_failure(result, *fragments)
    assert not (tmp_path / "d").exists() and not (tmp_path / "new.safetensors").exists()


def test_the_largest_values_in_range_pass_the_checks():
    from paroattn.app.options import MAX_FRAMES, MAX_PIXELS, MAX_STEPS, range_problem, size_problem

    assert size_problem(steps=MAX_STEPS, height=MAX_PIXELS, width=MAX_PIXELS, frames=MAX_FRAMES) is None
    assert size_problem(steps=None, height=None, width=None, frames=None) is None
    assert range_problem("--x", 0, 0, 3, "things") is None
    assert range_problem("--x", 4, 0, 3, "things", "0 turns it off") == (
        "--x 4: pass a number of things from 0 to 3 (0 turns it off)")


def small_plan(path):
    from paroattn import Plan, TokenLayout

    Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=2, num_heads=2, density=0.5, num_buckets=1,
                   block_size=16).save(path)
    return path


@pytest.mark.parametrize("args, fragments", [
    (["--heads", "9:9"], ["--heads goes with --png", "pass --png DIR too"]),
    (["--heads", "0:0"], ["--heads goes with --png"]),
    (["--overwrite"], ["--overwrite goes with --png"]),
])
def test_inspect_refuses_options_that_refine_png_without_it(tmp_path, args, fragments):
    result = invoke(["inspect", small_plan(tmp_path / "p.safetensors"), *args])
    assert_clean_failure(result, *fragments)


def test_inspect_png_default_heads_are_those_the_plan_has(tmp_path):
    from paroattn import Plan, TokenLayout

    path = tmp_path / "one-head.safetensors"
    Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=1, num_heads=1, density=0.5, num_buckets=1,
                   block_size=16).save(path)
    result = invoke(["inspect", path, "--png", tmp_path / "png"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["layer000_head000.png"]
    result = invoke(["inspect", path, "--png", tmp_path / "png2", "--heads", "9:9"])
    assert_clean_failure(result, "--heads 9:9 not in the plan")


def test_calibrate_refuses_buckets_that_bucket_edges_would_override(tmp_path, monkeypatch):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "new.safetensors", "--buckets", "4",
                     "--bucket-edges", "1000,500,0"])
    assert_clean_failure(result, "--buckets and --bucket-edges both choose", "pass one of them")


@pytest.mark.parametrize("args", [["--block-q", "128"], ["--block-k", "64"], ["--backend", "cuda"], ["--overwrite"]])
def test_bench_refuses_run_options_beside_table(tmp_path, args):
    results = tmp_path / "r.json"
    results.write_text('{"rows": []}')
    result = invoke(["bench", "--table", results, *args])
    assert_clean_failure(result, f"{args[0]} goes with a run, not with --table")
