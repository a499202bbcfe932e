from typer.testing import CliRunner

from paroattn import Plan, TokenLayout
from paroattn.app.cli import app

runner = CliRunner()


def test_inspect_prints_a_summary(tmp_path):
    plan = Plan.synthetic(layout=TokenLayout(10, 2, 4, 6), num_layers=2, num_heads=3, density=0.5, orders="HWF",
                          num_buckets=2, block_size=16, model_class="WanTransformer3DModel", model_fingerprint="f00d")
    plan.dense[1, 1] = True
    path = tmp_path / "plan.safetensors"
    plan.save(path)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "WanTransformer3DModel" in out and "10 + 2x4x6" in out
    assert "HWF:6" in out and "FHW:0" in out
    assert "dense" in out and "KiB" in out
    assert "0: (500, 1000]" in out and "1: (0, 500]" in out


def test_inspect_reports_bad_files_without_a_traceback(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"garbage")
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2
    assert "truncated or corrupt" in result.output
    assert "Traceback" not in result.output
