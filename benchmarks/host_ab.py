"""Eager host time per call of two versions of the code, alternated in one process.

The device machine's host varies by up to 30% between processes of identical code, so a before/after
comparison of host time runs both versions in one process: the other version's `paroattn` package is
copied under another name (`paroattn_other`, its custom op renamed to match), both are imported, and
their calls alternate over rounds of 1000 calls (best of 3 per round). Short shape (1, 24, 1024, 128),
d=0.5, 128 x 64 blocks, active-block lists; bf16 and int8 QK + fp8 PV, without and with RoPE tables;
SDPA each round; the CUDA-graph replay of this version's calls (GPU time alone); and the host time alone
(`attention.host_us`: 100 calls issued on an idle GPU, timed without waiting for it).

    python benchmarks/host_ab.py OTHER_CHECKOUT [--rounds 6] [--json results.json]
    # e.g. OTHER_CHECKOUT from: git worktree add /tmp/before <commit>

docs/notes/host-overhead.md has the method and the numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import _graph_ms, environment, host_inputs, host_us, wall_us  # noqa: E402

import paroattn  # noqa: E402

OTHER = "paroattn_other"


def import_other(checkout: Path):
    """The other checkout's `paroattn` as the package `paroattn_other` (a copy; its imports are relative)."""
    root = Path(tempfile.mkdtemp())
    shutil.copytree(checkout / "paroattn", root / OTHER, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    for source in (root / OTHER / "kernels").glob("*.py"):  # one op name per library
        if '"paroattn::' in (text := source.read_text()):
            source.write_text(text.replace('"paroattn::', f'"{OTHER}::'))
    sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module(OTHER)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("other", type=Path, help="a checkout of the other version (its paroattn/ is copied)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    versions = {"other": import_other(args.other), "this": paroattn}
    layout, (q, k, v), mask, orders, rotary = host_inputs("short", 0.5, torch.Generator(device="cuda").manual_seed(0))
    modes = {"bf16": ("bf16", "bf16", None), "int8+fp8": ("int8", "fp8", None),
             "int8+fp8 RoPE": ("int8", "fp8", rotary), "bf16 RoPE": ("bf16", "bf16", rotary)}
    calls = {}
    for name, package in versions.items():
        blocks = package.kernels.block_lists.ActiveBlocks.from_mask(mask).to("cuda")  # each version's own class
        own_layout = package.TokenLayout(layout.prefix, layout.frames, layout.height, layout.width)
        for mode, (qk, pv, tables) in modes.items():
            kwargs = dict(layout=own_layout, orders=orders, block_mask=blocks, block_size=(128, 64), qk=qk, pv=pv,
                          rotary=tables)
            calls[name, mode] = lambda package=package, kwargs=kwargs: package.paro_attention(q, k, v, **kwargs)
    for mode in modes:
        difference = (calls["this", mode]().float() - calls["other", mode]().float()).abs().max()
        print(f"{mode}: max |this - other| = {float(difference):.3g}", flush=True)
    times = {key: [] for key in calls}
    host = {key: [] for key in calls}
    sdpa, sdpa_host = [], []
    for r in range(args.rounds):
        for name in (("other", "this") if r % 2 == 0 else ("this", "other")):
            for mode in modes:
                times[name, mode].append(wall_us(calls[name, mode], 1000))
                host[name, mode].append(host_us(calls[name, mode]))
        sdpa.append(wall_us(lambda: F.scaled_dot_product_attention(q, k, v), 1000))
        sdpa_host.append(host_us(lambda: F.scaled_dot_product_attention(q, k, v)))
    graph = {mode: _graph_ms(lambda q, k, v, call=calls["this", mode]: call(), [(q, k, v)]) * 1e3 for mode in modes}
    print(f"\nus per call, min / median of {args.rounds} rounds: wall time back to back; host alone\n"
          "| mode | other | this | CUDA-graph replay | host alone, other | host alone, this |\n|---|---|---|---|---|---|")

    def cell(values):
        return f"{min(values):.0f} / {statistics.median(values):.0f}"

    for mode in modes:
        print(f"| {mode} | {cell(times['other', mode])} | {cell(times['this', mode])} | {graph[mode]:.0f} | "
              f"{cell(host['other', mode])} | {cell(host['this', mode])} |")
    print(f"| SDPA | {cell(sdpa)} | | | {cell(sdpa_host)} | |")
    if args.json:
        rows = [{"code": name, "mode": mode, "us_per_round": t, "min_us": min(t), "median_us": statistics.median(t),
                 "host_alone_us_per_round": host[name, mode]} for (name, mode), t in times.items()]
        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **environment(),
                "date": time.strftime("%Y-%m-%d"), "other": str(args.other)}
        args.json.write_text(json.dumps({"info": info, "sdpa_us": sdpa, "sdpa_host_alone_us": sdpa_host, "rows": rows,
                                         "cuda_graph_replay_us": graph}, indent=1))


if __name__ == "__main__":
    main()
