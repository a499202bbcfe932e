"""The op's precision modes, named and validated once for every layer above (kernels, op, plan,
calibration, CLI).

- `qk`: how Q and K enter the score product: "bf16" (the inputs' own 16-bit type), "int8" or "int4"
  (symmetric per block, K smoothed by its mean first; int4 values still run on int8 units).
- `pv`: how P and V enter the output product: "bf16", "fp8" (e4m3) or "int8".
- `k_scale`: how finely integer QK scales K: "block" (one scale per key block) or "token" (one per key,
  which keeps a loud key from coarsening the grid of the quiet ones in its block; a multiply per score more).
  Q keeps one scale per query block either way; with qk="bf16" nothing is scaled and it has no effect.
"""

from __future__ import annotations

QK_MODES = ("bf16", "int8", "int4")
PV_MODES = ("bf16", "fp8", "int8")
K_SCALES = ("block", "token")


def _wrong_modes(qk: str, pv: str, say) -> list[str]:
    """`say(name, value, modes)` for each of qk and pv that is not one of its modes."""
    return [say(name, value, modes) for name, value, modes in (("qk", qk, QK_MODES), ("pv", pv, PV_MODES))
            if value not in modes]


def modes_problem(qk: str, pv: str) -> str | None:
    """Why (qk, pv) is not a pair of modes, or None. Callers raise it as their own error type."""
    return "; ".join(_wrong_modes(qk, pv, lambda name, value, modes: f"{name}={value!r} is not one of {modes}")) or None


def mode_flags_problem(qk: str, pv: str) -> str | None:
    """`modes_problem` as the command line says it, naming the flags `--qk` and `--pv`, or None."""
    wrong = _wrong_modes(qk, pv, lambda name, value, modes: f"--{name} {value!r} is not one of {', '.join(modes)}")
    return "; ".join(wrong) + ": pass one of them" if wrong else None


def k_scale_problem(k_scale: str) -> str | None:
    """Why `k_scale` is not one of K_SCALES, or None. Callers raise it as their own error type."""
    return None if k_scale in K_SCALES else f"k_scale={k_scale!r} is not one of {K_SCALES}"
