"""Which oneDNN-prepacked weights pdserve's panel kernels can read in place.

Lifecycle: pure functions. ``onednn_panels`` is called once per linear layer when a model is packed at load
(engine/weight_formats.py ``Fp32Panels``); the view it returns is what the ``linear_panel`` kernel and the fused
decode layer read on every decode step, while oneDNN keeps the large products (prefill) on the same bytes.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

# panel widths to try, most likely first (torch 2.13's oneDNN uses 64 on AVX2 and AVX-512)
_PANEL_WIDTHS = (64, 32, 16, 48, 96, 128)


def onednn_panels(packed: torch.Tensor, dense: torch.Tensor) -> Optional[torch.Tensor]:
    """A float32 [NP, K, B] view of a weight oneDNN prepacked (``torch.ops.mkldnn._reorder_linear_weight``)
    in panels of B outputs, K-major inside a panel (p[n // B][k][n % B] = W[n, k]), for pdserve's
    ``linear_panel`` kernel; None where the packed bytes are not that layout.

    oneDNN chooses its layout by CPU and version and does not publish it, so this does not assume it: it
    compares the packed bytes with the dense [N, K] original under each candidate width and returns a view
    only where every weight is equal. A view that passes therefore computes this weight's product exactly
    as the dense one would, whatever oneDNN does elsewhere. The view shares the packed tensor's memory
    without holding it: keep ``packed`` alive as long as the view (engine/weight_formats.py keeps both)."""
    if dense.dtype != torch.float32 or dense.dim() != 2 or packed.device.type != "cpu":
        return None
    N, K = dense.shape
    try:
        nbytes, ptr = torch.ops.mkldnn._nbytes(packed), torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):  # not an opaque oneDNN tensor, or a torch without these ops
        return None
    for B in _PANEL_WIDTHS:
        NP = -(-N // B)
        if nbytes != NP * B * K * 4:
            continue
        view = torch.frombuffer((ctypes.c_float * (nbytes // 4)).from_address(ptr), dtype=torch.float32)
        view = view.view(NP, K, B)
        full = N // B
        same = torch.equal(view[:full], dense[:full * B].view(full, B, K).transpose(1, 2))
        if same and N % B:
            same = torch.equal(view[full, :, :N % B], dense[full * B:].t())
        if same:
            return view
    return None
