"""How close two generations are: PSNR, SSIM and cosine similarity of their pixels."""

from __future__ import annotations

import numpy as np
import torch


def compare_pixels(dense: np.ndarray, sparse: np.ndarray) -> dict[str, float]:
    """PSNR (dB, data range 1), SSIM (torchmetrics, per frame, averaged) and cosine similarity."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a = torch.from_numpy(dense).permute(0, 3, 1, 2).double()
    b = torch.from_numpy(sparse).permute(0, 3, 1, 2).double()
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    return {
        "psnr_db": float(peak_signal_noise_ratio(b, a, data_range=1.0)),
        "ssim": float(structural_similarity_index_measure(b, a, data_range=1.0)),
        "cosine": float(cosine),
    }
