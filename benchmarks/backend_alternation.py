"""One op call timed on each backend in turn, several rounds: the spread of a single measurement next to the
difference between backends. For each shape and density, every round times `paro_attention` with backend "cuda",
"auto" and "triton" (int8 QK + fp8 PV, 128 x 64 blocks) three ways: do_bench with L2 flushed (as
benchmarks/attention.py does), the wall time per eager call with the GPU work queued behind it, and the replay of a
CUDA graph of calls (GPU time alone). Where the wall time reaches the graph's time, the call is host-bound and a
do_bench median can jump with the host's hiccups.

    python benchmarks/backend_alternation.py --shapes flux.1-dev,wan2.1-1.3b --rounds 3 --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attention  # noqa: E402  (beside this script)

from paroattn import paro_attention  # noqa: E402
from paroattn.app.bench import SHAPES, environment, input_sets, median_ms  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402

BACKENDS = ("cuda", "auto", "triton")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="flux.1-dev,wan2.1-1.3b")
    p.add_argument("--densities", default="1.0,0.2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        B, H, layout, D = SHAPES[shape]
        N = layout.seq_len
        sets = input_sets(B, H, N, D, g)
        orders = torch.randint(0, 6, (H,), generator=torch.Generator().manual_seed(1))
        for density in map(float, args.densities.split(",")):
            mask = synthetic_block_mask(H, -(-N // 128), -(-N // 64), density,
                                        generator=torch.Generator().manual_seed(2))
            blocks = ActiveBlocks.from_mask(mask).to("cuda")
            for turn in range(args.rounds):
                for backend in BACKENDS:
                    def paro(q, k, v, backend=backend):
                        return paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, qk="int8",
                                              pv="fp8", block_size=(128, 64), backend=backend)

                    row = {"shape": shape, "density": density, "backend": backend, "round": turn,
                           "do_bench_ms": median_ms(paro, sets), **attention._host_overhead(paro, sets)}
                    rows.append(row)
                    print(f"{shape:16s} d={density:<4} {backend:7s} round {turn}: do_bench {row['do_bench_ms']:.3f} ms, "
                          f"wall {row['host_us_per_call']:.0f} us, graph {row['cuda_graph_us_per_call']:.0f} us",
                          flush=True)
        sets = None
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({**environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
