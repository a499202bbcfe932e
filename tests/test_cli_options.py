"""Every option and argument of every `paro` command, checked the same way: an empty value gets one line naming
it as typed, before anything loads or is written; `-h` works everywhere; help explains its terms; warnings print
as one line. And `paro demo`'s defaults: a fresh folder per run, density 1 without calibration, other sizes."""

from __future__ import annotations

import json
import warnings

import pytest
import typer
from typer.testing import CliRunner

from paroattn.app.cli import app

COMMANDS = ["calibrate", "generate", "inspect", "demo", "demo-pipeline"]


def invoke(args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_error_line(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], result.output


def value_options(command: str) -> list[str]:
    """The flags of `command` that take a value."""
    click_command = typer.main.get_command(app).commands[command]
    return [opt for param in click_command.params if param.param_type_name == "option" and not param.is_flag
            for opt in param.opts]


def arguments(command: str) -> list[str]:
    click_command = typer.main.get_command(app).commands[command]
    return [param.metavar or param.name.upper() for param in click_command.params
            if param.param_type_name == "argument"]


def no_model_loads(monkeypatch):
    import paroattn.app.generate as generate
    import paroattn.demo_model.model as demo_model

    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(demo_model, "load_demo_pipeline", lambda *a, **k: pytest.fail("loaded the demo model"))


def base_args(command: str, tmp_path) -> list:
    """A command line whose own values are valid enough to reach the option under test."""
    return {"calibrate": [tmp_path / "model", "--out", tmp_path / "p.safetensors"],
            "generate": [tmp_path / "model", "--prompt", "a cat"],
            "inspect": [tmp_path / "p.safetensors"], "demo": [], "demo-pipeline": [tmp_path / "d"]}[command]


@pytest.mark.parametrize("command, flag", [(c, f) for c in COMMANDS for f in value_options(c)])
@pytest.mark.parametrize("form", ["separate", "equals", "blank"])
def test_an_empty_option_value_names_the_option(tmp_path, monkeypatch, command, flag, form):
    no_model_loads(monkeypatch)
    value = " " if form == "blank" else ""
    given = [f"{flag}={value}"] if form == "equals" else [flag, value]
    result = invoke([command, *base_args(command, tmp_path), *given])
    assert_one_error_line(result, f"{flag} is empty; expected ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [c for c in COMMANDS if arguments(c)])
def test_an_empty_argument_names_the_argument(tmp_path, monkeypatch, command):
    no_model_loads(monkeypatch)
    rest = {"calibrate": ["--out", tmp_path / "p.safetensors"], "generate": ["--prompt", "a cat"]}.get(command, [])
    result = invoke([command, "", *rest])
    assert_one_error_line(result, f"{arguments(command)[0]} is empty; expected ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, flag, value, kind", [
    (c, f, "abc", None) for c in ("calibrate", "generate", "demo") for f in ("--steps", "--seed", "--height")
] + [("demo", "--density", "x", None), ("calibrate", "--density", "x", None), ("calibrate", "--quant-weight", "x", None)])
def test_an_ill_typed_value_names_the_option(tmp_path, monkeypatch, command, flag, value, kind):
    no_model_loads(monkeypatch)
    result = invoke([command, *base_args(command, tmp_path), flag, value])
    assert_one_error_line(result, f"{flag} '{value}': expected ")


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_every_command_takes_dash_h(command):
    short, long = invoke([*command, "-h"]), invoke([*command, "--help"])
    assert short.exit_code == 0 and short.output == long.output, short.output


def test_calibrate_help_explains_its_terms():
    text = " ".join(invoke(["calibrate", "--help"]).output.split())
    assert "paper (the PAROAttention paper's score" in text
    assert "incoherence in the mass metric: a block's largest attention value over its mean" in text
    assert "ending in .safetensors" in text


def test_a_library_warning_prints_as_one_line(tmp_path, monkeypatch):
    """A warning raised while a command runs reads `warning: ...`, without Python's source line."""
    import paroattn.app.demo as demo

    def warns(*args, **kwargs):
        warnings.warn("something to know\nacross two lines", UserWarning, stacklevel=1)
        raise ValueError("stopped here")

    monkeypatch.setattr(demo, "_run_demo", warns)
    result = invoke(["demo", "--out-dir", tmp_path / "d", "--device", "cpu"])
    assert result.exit_code == 2
    assert result.output.splitlines()[0] == "warning: something to know across two lines", result.output
    assert "UserWarning" not in result.output and ".py:" not in result.output


# -- paro demo: defaults, density 1, sizes ----------------------------------------------------------

def test_default_out_dir_never_names_an_existing_folder(tmp_path):
    from paroattn.app.demo import default_out_dir

    assert default_out_dir(tmp_path) == tmp_path / "paro-demo"
    (tmp_path / "paro-demo").mkdir()
    assert default_out_dir(tmp_path) == tmp_path / "paro-demo-2"
    (tmp_path / "paro-demo-2").write_text("a file counts too")
    assert default_out_dir(tmp_path) == tmp_path / "paro-demo-3"


def test_two_demo_runs_without_out_dir_write_two_folders(tmp_path, monkeypatch):
    import paroattn.app.demo as demo

    written = []

    def record(out, **kwargs):
        written.append(out)
        (out / "metrics.json").write_text("{}")
        return {}

    monkeypatch.setattr(demo, "_run_demo", record)
    monkeypatch.chdir(tmp_path)
    for args in ([], ["--density", "0.3"]):
        result = invoke(["demo", "--device", "cpu", *args])
        assert result.exit_code == 0, result.output
    assert [p.name for p in written] == ["paro-demo", "paro-demo-2"]


@pytest.fixture(scope="module")
def full_density_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    result = invoke(["demo", "--out-dir", out, "--density", "1", "--steps", "1", "--num-prompts", "1", "--height", "16",
                     "--width", "24", "--frames", "3", "--device", "cpu"])
    return out, result


@pytest.mark.slow
def test_density_one_needs_no_calibration_and_equals_dense(full_density_run):
    out, result = full_density_run
    assert result.exit_code == 0, result.output
    assert "full density" in result.output and "calibrat" not in result.output.replace("nothing to calibrate", "")
    report = json.loads((out / "metrics.json").read_text())
    assert report["plan"] is None and report["density"] == 1.0
    assert report["metrics"]["cosine"] > 0.99999  # every block kept: the model's own attention, up to rounding
    assert not (out / "plan.safetensors").exists()


@pytest.mark.slow
def test_the_demo_runs_at_the_size_asked_for_and_labels_what_it_computed(full_density_run):
    out, result = full_density_run
    report = json.loads((out / "metrics.json").read_text())
    assert report["size"] == {"frames": 3, "height": 16, "width": 24}
    assert "3 frames of 16x24" in result.output
    # on a CPU the model is float32, and "bf16" modes compute in the model's type: the run says fp32
    assert report["dtype"] == "torch.float32" and report["computed_in"] == "fp32/fp32"
    paro = next(line for line in result.output.splitlines() if line.startswith("PARO d=") and " s total" in line)
    assert "qk=fp32 pv=fp32" in paro


@pytest.mark.slow
def test_an_unshipped_density_says_how_it_is_calibrated(tmp_path):
    from paroattn.app.demo import run_demo

    lines = []
    run_demo(tmp_path, density=0.4, steps=2, num_prompts=1, height=16, width=16, frames=2, device="cpu",
             log=lines.append)
    said = next(line for line in lines if line.startswith("no shipped plan for density 0.4"))
    assert "2 calibration prompts" in said and "2 steps" in said and "held out" in said


# -- sizes a model cannot take, from its folder's configs, before it loads ----------------------------

def pipeline_configs(folder, pipeline: str, transformer: dict, vae: dict | None):
    """A pipeline folder with configs only (no weights): all that the size check reads."""
    folder.mkdir()
    index = {"_class_name": pipeline, "transformer": ["diffusers", transformer["_class_name"]]}
    (folder / "transformer").mkdir()
    (folder / "transformer" / "config.json").write_text(json.dumps(transformer))
    if vae is not None:
        index["vae"] = ["diffusers", vae["_class_name"]]
        (folder / "vae").mkdir()
        (folder / "vae" / "config.json").write_text(json.dumps(vae))
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


WAN = ("WanPipeline", {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "rope_max_seq_len": 1024},
       {"_class_name": "AutoencoderKLWan", "scale_factor_spatial": 8, "scale_factor_temporal": 4})
WAN_TI2V = ("WanPipeline", WAN[1], {**WAN[2], "scale_factor_spatial": 16})
COGVIDEOX = ("CogVideoXPipeline", {"_class_name": "CogVideoXTransformer3DModel", "patch_size": 2, "patch_size_t": None},
             {"_class_name": "AutoencoderKLCogVideoX", "block_out_channels": [128, 256, 256, 512]})
HUNYUAN = ("HunyuanVideoPipeline", {"_class_name": "HunyuanVideoTransformer3DModel", "patch_size": 2, "patch_size_t": 1},
           {"_class_name": "AutoencoderKLHunyuanVideo", "spatial_compression_ratio": 8})
FLUX = ("FluxPipeline", {"_class_name": "FluxTransformer2DModel", "patch_size": 1},
        {"_class_name": "AutoencoderKL", "block_out_channels": [128, 256, 512, 512]})


@pytest.mark.parametrize("configs, height, problem", [
    (WAN, 480, None), (WAN, 472, "multiples of 16 pixels"), (WAN_TI2V, 704, None), (WAN_TI2V, 720, "multiples of 32"),
    (COGVIDEOX, 480, None), (COGVIDEOX, 488, "multiples of 16 pixels"), (HUNYUAN, 720, None),
    (HUNYUAN, 724, "multiples of 16 pixels"),
    (FLUX, 1000, None),  # image pipelines resize to their multiple themselves
])
def test_a_height_the_model_cannot_take_is_refused_from_its_configs(tmp_path, monkeypatch, configs, height, problem):
    from paroattn.app.generate import size_fit_problem

    folder = pipeline_configs(tmp_path / "model", *configs)
    found = size_fit_problem(folder, height, None, None)
    if problem is None:
        assert found is None
        return
    assert found.startswith(f"--height {height}: ") and problem in found, found
    no_model_loads(monkeypatch)
    result = invoke(["generate", folder, "--prompt", "a cat", "--height", height, "--out", tmp_path / "x.mp4"])
    assert_one_error_line(result, f"--height {height}", problem)


def test_configs_that_do_not_tell_leave_the_size_to_the_pipeline(tmp_path):
    from paroattn.app.generate import size_fit_problem

    unknown_vae = pipeline_configs(tmp_path / "model", WAN[0], WAN[1], {"_class_name": "SomeOtherVAE"})
    assert size_fit_problem(unknown_vae, 471, 471, 81) is None
    assert size_fit_problem(tmp_path / "missing", 471, 471, 81) is None


def test_generate_default_output_never_replaces_an_earlier_one(tmp_path):
    from paroattn.app.options import default_output

    assert default_output(True, folder=tmp_path) == tmp_path / "out.mp4"
    assert default_output(False, folder=tmp_path) == tmp_path / "out.png"
    (tmp_path / "out.mp4").write_text("x")
    assert default_output(True, folder=tmp_path) == tmp_path / "out-2.mp4"
    (tmp_path / "out-2_dense.mp4").write_text("x")  # a --compare run's dense video
    assert default_output(True, compare=True, folder=tmp_path) == tmp_path / "out-3.mp4"
    assert default_output(True, compare=False, folder=tmp_path) == tmp_path / "out-2.mp4"
