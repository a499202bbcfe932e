"""Host time per call of the op's paths, alternated in one process: the eager call (`paro_attention`), the custom
op a compiled graph calls (`torch.ops.paroattn.block_sparse_attention`), and the op's body (`launch.launch`) with the
stream's kept buffer set and with a new set per call. The GPU is kept busy (`torch.cuda._sleep`) while each batch of
calls is issued, so the time is the host's alone. Backends cuda and triton, int8 QK + fp8 PV, 128 x 64 blocks.

    python benchmarks/custom_op_host.py --shape flux.1-dev --density 0.2 --rounds 7 --out results.json

docs/notes/host-overhead.md has the method and the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attention  # noqa: E402  (beside this script)

from paroattn import paro_attention  # noqa: E402
from paroattn.app.bench import SHAPES, environment  # noqa: E402
from paroattn.attention import decide  # noqa: E402
from paroattn.kernels import launch  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks  # noqa: E402

CALLS = 60  # per batch: few enough that the launch queue never fills behind the sleep


def host_us(fn) -> float:
    """Host time per call of one batch of CALLS calls issued behind a sleeping GPU (`attention.host_us` takes the
    best of 5 batches from an idle one): each round gives one sample of the median."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / CALLS * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="flux.1-dev", choices=list(SHAPES))
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    layout, (q, k, v), mask, device_orders, _ = attention.host_inputs(args.shape, args.density,
                                                                      torch.Generator(device="cuda").manual_seed(0))
    N, D = q.shape[2], q.shape[3]
    orders = device_orders.cpu()  # as a caller passes them
    blocks = ActiveBlocks.from_mask(mask).to("cuda")
    geometry = (layout.prefix, layout.frames, layout.height, layout.width, 128, 64, "int8", "fp8", D ** -0.5)
    rows = []
    for backend in ("cuda", "triton"):
        code = decide(q, 128, 64, "int8", "fp8", backend).encode()

        def body(reuse, code=code):
            return launch.launch(launch.PROCESS.launch_of(code), q, k, v, device_orders,
                                 ActiveBlocks(blocks.counts, blocks.indices, -(-N // 64), blocks.schedule), *geometry,
                                 reuse_buffers=reuse)

        paths = {
            "eager call": lambda backend=backend: paro_attention(
                q, k, v, layout=layout, orders=orders, block_mask=blocks, qk="int8", pv="fp8", block_size=(128, 64),
                backend=backend),
            "custom op": lambda code=code: torch.ops.paroattn.block_sparse_attention(
                q, k, v, device_orders, blocks.counts, blocks.indices, blocks.schedule, *geometry, code),
            "op body, kept buffer set": lambda: body(True),
            "op body, new buffers per call": lambda: body(False),
        }
        expected = paths["eager call"]()
        times = {name: [] for name in paths}
        for name, fn in paths.items():
            assert torch.equal(fn(), expected), name  # every path computes the same output
            for _ in range(20):
                fn()
        for _ in range(args.rounds):
            for name, fn in paths.items():
                times[name].append(host_us(fn))
        for name, values in times.items():
            row = {"backend": backend, "path": name, "median_us": statistics.median(values), "min_us": min(values),
                   "max_us": max(values), "rounds_us": values}
            rows.append(row)
            print(f"{backend:6s} {name:30s} host {row['median_us']:6.1f} us per call (min {row['min_us']:.1f}, "
                  f"max {row['max_us']:.1f})", flush=True)
    args.out.write_text(json.dumps({**environment(), "shape": args.shape, "density": args.density,
                                    "calls_per_batch": CALLS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
