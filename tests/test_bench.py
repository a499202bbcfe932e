"""`paro bench` and the full benchmark's tables: options checked before a GPU is asked for, saved results printed
anywhere with the kernel that ran each row, and a file that holds no timings refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from paroattn.app.bench import read_results, table
from paroattn.app.cli import app

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# rows name the kernel only since the sm90 comparison; this file (the op table of BENCHMARKS.md) records configs
CONFIGS_ONLY = RESULTS / "attention-nvidia-h100-80gb-hbm3-bq128-bk64.json"
KERNELS_NAMED = RESULTS / "attention-sm90-cuda-fa3-nvidia-h100-bq128-bk64.json"


def invoke(args):
    return CliRunner().invoke(app, ["bench", *map(str, args)])


def assert_one_line_failure(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], result.output


@pytest.fixture
def no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def rows_of(text: str) -> dict[str, list[str]]:
    """{"<model> <method>": cells} of a table `paro bench` printed; a model's later rows leave its cell empty."""
    out, model = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 4 and cells[2] not in ("method", "---"):
            model = cells[0] or model
            out[f"{model.split(' (')[0]} {cells[2]}"] = cells[3:]
    return out


# -- options, before any GPU work -----------------------------------------------------------------

@pytest.mark.parametrize("args, fragments", [
    (["--shapes", "nonsense"], ["--shapes 'nonsense'", "'nonsense' is not one", "cogvideox-5b", "wan2.1-1.3b"]),
    (["--shapes", ","], ["--shapes ','", "expected comma-separated shape names"]),
    (["--densities", "0"], ["--densities '0'", "(0, 1]"]),
    (["--densities", "x"], ["--densities 'x'", "e.g. --densities 1.0,0.5"]),
    (["--modes", "int8"], ["--modes 'int8'", "qk+pv pairs", "int8+fp8"]),
    (["--modes", "int8+fp4"], ["--modes 'int8+fp4'", "pv: bf16, fp8, int8"]),
    (["--block-q", "32"], ["--block-q 32", "64 or 128"]),
    (["--backend", "torch"], ["--backend 'torch'", "auto, triton, cuda"]),
    (["--out", "results.txt"], ["--out results.txt", ".json"]),
    (["--table", "/nonexistent.json"], ["--table /nonexistent.json", "No such file"]),
    (["--table", CONFIGS_ONLY, "--out", "x.json"], ["--out goes with a run, not with --table"]),
    (["--frobnicate"], ["No such option: --frobnicate"]),
])
def test_bad_options_end_in_one_line_before_a_gpu_is_asked_for(no_gpu, tmp_path, monkeypatch, args, fragments):
    monkeypatch.chdir(tmp_path)
    assert_one_line_failure(invoke(args), *fragments)
    assert list(tmp_path.iterdir()) == []


def test_without_a_gpu_a_run_says_so_in_one_line(no_gpu):
    assert_one_line_failure(invoke(["--shapes", "short"]), "CUDA GPU", "--table RESULTS.json")


# -- --table on files that hold no timings --------------------------------------------------------

@pytest.mark.parametrize("content, found", [
    ("{}", "holds an empty object"),
    ("[]", "holds an empty list"),
    ("{not json", "is not a readable JSON file"),
    ('{"rows": [{"shape": "short", "method": "paro-bf16-bf16"}]}', "holds an object with keys rows"),
    ('{"rows": [{"shape": "short", "B": 1, "H": 2, "N": 3, "D": 4, "method": "sdpa-default", "density": "1",'
     ' "ms": 1.0}]}', "holds an object with keys rows"),
])
def test_table_of_a_file_without_timings_is_one_line(no_gpu, tmp_path, content, found):
    path = tmp_path / "r.json"
    path.write_text(content)
    assert_one_line_failure(invoke(["--table", path]), f"--table {path} {found}", "written by paro bench")


def test_table_of_a_demo_metrics_file_is_one_line(no_gpu, tmp_path):
    """What `paro demo` writes beside its GIF: the first JSON a new user has at hand."""
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"plan": "plan.safetensors", "target_density": 0.5, "metrics": {"psnr_db": 30.0},
                                "per_prompt": [{"psnr_db": 30.0}]}))
    assert_one_line_failure(invoke(["--table", path]), "keys plan, target_density, metrics, per_prompt",
                            "not the timings of paro bench")


@pytest.mark.slow
def test_table_of_a_host_time_file_names_the_script_that_prints_it(no_gpu):
    path = RESULTS / "host-nvidia-h100-80gb-hbm3.json"
    assert_one_line_failure(invoke(["--table", path]), "host_rows", "not the timings of paro bench")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--table", str(path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "| host alone, lists |" in result.stdout, result.stderr[-2000:]


# -- --table on saved results: the kernel of every row --------------------------------------------

def test_table_names_each_rows_kernel_from_files_that_record_only_configs(no_gpu):
    """Files written before rows named their kernel record the Triton config: bf16 at head dim 128 (its config
    warp-specialized) ran the Gluon kernel, every other paro row the Triton kernel (as BENCHMARKS.md says)."""
    result = invoke(["--table", CONFIGS_ONLY, "--modes", "bf16+bf16,int8+fp8", "--densities", "1.0,0.2"])
    assert result.exit_code == 0, result.output
    rows = rows_of(result.output)
    assert rows["CogVideoX-5B paro-bf16-bf16"][0] == "triton"  # head dim 64: not warp-specialized
    assert rows["Wan2.1-1.3B paro-bf16-bf16"][0] == "gluon-warp-specialized"
    assert rows["FLUX.1-dev paro-bf16-bf16"][0] == "gluon-warp-specialized"
    assert {cells[0] for name, cells in rows.items() if "paro-int8-fp8" in name} == {"triton"}
    saved = json.loads(CONFIGS_ONLY.read_text())["rows"]
    assert not any("kernel" in r for r in saved)  # the test reads what it says it reads
    wan_dense = next(r for r in saved if (r["shape"], r["method"], r["density"]) == ("wan2.1-1.3b", "paro-int8-fp8", 1.0))
    sdpa = next(r["ms"] for r in saved if (r["shape"], r["method"]) == ("wan2.1-1.3b", "sdpa-default"))
    assert rows["Wan2.1-1.3B paro-int8-fp8"][1] == f"{wan_dense['ms']:.2f} ms, {sdpa / wan_dense['ms']:.2f}x"
    assert "| d=1 | d=0.2 |" in result.output and "paro-int8-bf16" not in result.output


def test_table_shows_the_kernels_a_file_names(no_gpu):
    result = invoke(["--table", KERNELS_NAMED, "--shapes", "wan2.1-1.3b"])
    assert result.exit_code == 0, result.output
    rows = rows_of(result.output)
    assert rows["Wan2.1-1.3B paro-sm90-int8-fp8"][0] == "sm90-cuda"
    assert rows["Wan2.1-1.3B fa3-fp8"][0] == "flash-attention-3"
    assert rows["Wan2.1-1.3B paro-int8-fp8"][0] == "triton"
    assert "CogVideoX-5B" not in result.output


def test_every_committed_attention_results_file_prints_or_is_refused_in_one_line():
    for path in sorted(RESULTS.glob("attention*.json")):
        try:
            results = read_results(path)
        except ValueError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("holds"), (path, exc)
            continue
        text = table(results)
        assert "?" not in text and text.count("\n") > 3, path
        paro = [line for line in text.splitlines() if "| paro-" in line]
        assert paro and not any("| - |" in line for line in paro), path  # a paro row always names its kernel


@pytest.mark.slow
def test_full_benchmark_summary_names_each_rows_kernel():
    """benchmarks/attention.py --table --summary: the op table of BENCHMARKS.md, kernel column included."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--table", str(CONFIGS_ONLY),
                             "--summary", "--shapes", "cogvideox-5b,wan2.1-1.3b"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("| ") and "ms" in line]
    kernels = [[c.strip() for c in line.split("|")][4] for line in lines]
    assert kernels == ["triton", "triton", "gluon-warp-specialized", "triton"], result.stdout


@pytest.mark.slow
def test_full_benchmark_refuses_a_file_without_timings_in_one_line(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("{}")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--table", str(path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1 and "holds an empty object" in result.stderr, result.stderr


# -- a run (GPU) -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_run_writes_results_its_table_reads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--shapes", "short", "--modes", "bf16+bf16,int8+fp8", "--densities", "1.0,0.5"]
    first, second = invoke(args), invoke(args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    # the second run did not replace the first ("-2" sorts before ".json": order by name length)
    written = sorted(tmp_path.glob("paro-bench-*.json"), key=lambda path: (len(path.name), path.name))
    assert len(written) == 2 and written[1].stem == written[0].stem + "-2", written
    results = read_results(written[0])
    rows = rows_of(table(results))
    assert set(rows) == {"short sequence paro-bf16-bf16", "short sequence paro-int8-fp8"}
    assert all(r["ms"] > 0 for r in results["rows"]) and all(r["kernel"] != "-" for r in results["rows"][1:])
    assert rows_of(first.output) == rows


def _benchmark(name: str):
    """benchmarks/NAME.py, imported as its sibling scripts import it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return __import__(name)


def test_anchor_table_sets_paro_beside_its_peers_and_names_what_auto_ran():
    """--table --anchors: each model's speedups over SDPA of FA3, SageAttention2 (kernel and whole call) and paro's
    int8+fp8 on each kernel and as auto ran it, density by density; what a file did not time says so."""
    rows = [{"shape": "wan2.1-1.3b", "B": 1, "H": 12, "N": 32760, "D": 128, "method": method, "density": density,
             "ms": ms, **extra}
            for method, density, ms, extra in [
                ("sdpa-default", 1.0, 12.0, {}), ("fa3-fp8", 1.0, 8.0, {}), ("sage2-sm90-kernel", 1.0, 7.5, {}),
                ("sage2-sm90", 1.0, 8.0, {}), ("paro-int8-fp8", 1.0, 10.0, {}), ("paro-int8-fp8", 0.2, 2.0, {}),
                ("paro-sm90-int8-fp8", 1.0, 8.0, {"kernel": "sm90-cuda"}),
                ("paro-sm90-int8-fp8", 0.2, 1.5, {"kernel": "sm90-cuda"}),
                ("paro-auto-int8-fp8", 1.0, 8.0, {"kernel": "sm90-cuda", "same_output_as": "cuda"}),
                ("paro-auto-int8-fp8", 0.2, None, {"kernel": "sm90-cuda", "same_output_as": "cuda"})]]
    rows.append({**rows[0], "shape": "flux.1-dev", "N": 4608, "ms": 0.5})
    text = _benchmark("attention").anchor_table({"gpu": "NVIDIA H200", "rows": rows})
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    wan = dict(zip(header, [c.strip() for c in lines[1].split("|")[1:-1]]))
    assert wan["SDPA default"] == "12.00 ms" and wan["FA3 FP8"] == "1.50x" and wan["FA3 bf16"] == "not run"
    assert wan["SageAttention2 kernel"] == "1.60x" and wan["SageAttention2 call"] == "1.50x"
    assert wan["paro Triton: d=1 / d=0.2"] == "1.20x / 6.00x" and wan["paro CUDA: d=1 / d=0.2"] == "1.50x / 8.00x"
    assert wan["paro auto: d=1 / d=0.2"] == "1.50x / failed" and wan["auto ran"] == "sm90-cuda, output equal to backend='cuda'"
    flux = dict(zip(header, [c.strip() for c in lines[2].split("|")[1:-1]]))
    assert flux["model"] == "FLUX.1-dev" and flux["auto ran"] == "not run"
    assert flux["paro CUDA: d=1 / d=0.2"] == "not run / not run"


@pytest.mark.slow
def test_full_benchmark_refuses_a_sage2_folder_without_its_source_and_anchors_without_a_file(tmp_path):
    for args, fragment in [(["--sage2", str(tmp_path)], "thu-ml/SageAttention"),
                           (["--anchors"], "--anchors goes with --table")]:
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), *args],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr


def test_sage2_anchor_orders_v_keys_as_its_transpose_kernel_stores_them():
    """SageAttention2's transpose_pad_permute kernel stores key m of every 16 at row (m / 8) * 2 + ((m / 2) % 4) * 4
    + m % 2; the anchor's V^T must hold the same keys at the same places or its kernel computes another product."""
    import torch

    keys = torch.arange(48, dtype=torch.uint8).view(torch.float8_e4m3fn).view(1, 1, 1, 48)
    stored = _benchmark("sage2_anchor")._permute_keys(keys).view(torch.uint8).flatten().tolist()
    for m in range(48):
        within = m % 16
        assert stored[m - within + (within // 8) * 2 + ((within // 2) % 4) * 4 + within % 2] == m
