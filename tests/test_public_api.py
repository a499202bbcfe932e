"""The public API as `help(paroattn)` and the docstrings present it, and its edges: what the docs say is what
the code does."""

from __future__ import annotations

import pydoc
import warnings

import pytest
import torch

import paroattn
from paroattn import PAROInputError, TokenLayout, paro_attention


def test_help_lists_every_public_name():
    text = pydoc.render_doc(paroattn, renderer=pydoc.plaintext)
    assert "apply(pipe_or_transformer" in text and "class PAROProcessor" in text
    for name in paroattn.__all__:
        assert name in dir(paroattn) and name in text, name


def test_apply_docstring_says_other_sizes_derive_their_masks():
    doc = " ".join(paroattn.apply.__doc__.split())
    assert "derived" in doc and "replaces" in doc and "restores" in doc
    assert "another resolution or frame count raises PlanError" not in doc


def test_processor_docstring_names_every_backend():
    from paroattn.attention import BACKENDS

    doc = paroattn.PAROProcessor.__doc__
    for backend in BACKENDS:
        assert f'"{backend}"' in doc, backend


def test_auto_runs_the_reference_on_a_cpu_without_a_warning():
    """What the README says of backend="auto" on a CPU: the reference runs, and nothing warns (a GPU would run
    the kernels; there is nothing to fall back from)."""
    q = torch.randn(1, 2, 64, 64)
    args = dict(layout=TokenLayout(0, 1, 8, 8), orders=torch.zeros(2, dtype=torch.long),
                block_mask=torch.ones(2, 1, 1, dtype=torch.bool))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = paro_attention(q, q, q, backend="auto", **args)
    torch.testing.assert_close(out, paro_attention(q, q, q, backend="torch", **args))


def test_head_dim_zero_is_refused_as_a_contract_error():
    q = torch.zeros(1, 1, 4, 0)
    with pytest.raises(PAROInputError, match=r"head dim D >= 1 .*\(1, 1, 4, 0\)"):
        paro_attention(q, q, q, layout=TokenLayout(0, 1, 2, 2), orders=torch.zeros(1, dtype=torch.long),
                       block_mask=torch.ones(1, 1, 1, dtype=torch.bool))


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_plan_files_get_the_permissions_of_other_outputs(tmp_path, umask):
    """safetensors writes 0600 files; a plan and its stats file get what the umask gives any other output."""
    import os
    import stat

    from paroattn import Plan
    from paroattn.calibrate.accumulate import CalibrationResult
    from paroattn.calibrate.driver import save_calibration

    plan = Plan.synthetic(layout=TokenLayout(0, 1, 8, 8), num_layers=1, num_heads=2)
    result = CalibrationResult(candidate_orders=[0], orders=plan.orders, block_mask=plan.block_mask,
                               density=plan.density, kept_mass=torch.ones(1, 1, 2), scores=torch.zeros(1, 2, 1),
                               steps_per_bucket=[1], figure_layers=[0], figure_original=None, figure_reordered=None)
    previous = os.umask(umask)
    try:
        paths = save_calibration(plan, result, tmp_path / "plan.safetensors")
        (tmp_path / "other.txt").write_text("x")
    finally:
        os.umask(previous)
    expected = stat.S_IMODE((tmp_path / "other.txt").stat().st_mode)
    assert expected == 0o666 & ~umask
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
