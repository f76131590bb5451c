"""Ignored tokens left out of the work: each token chunk's live tokens first, counted on device.

An ignored token (target ``ignore_index``) has zero loss and zero gradient, so where its lse is
never used (not returned, no recomputing backward) its row of logits need not exist. The fast
forward (``skip_ignored``) orders each chunk's tokens live-first and gathers their rows of x;
our logits GEMM computes only the row tiles below the chunk's live count and the row kernel
blanks the rows past it (dz = 0, nothing read), both reading the count from device memory, so
nothing waits for the host. The dW GEMM (cuBLAS) still runs over the whole chunk, the blank
rows adding zeros, and so does dX's unless ``dx_gemm="triton"`` computes the live rows only
(:mod:`.dx_gemm`).
"""
from __future__ import annotations

import torch


def live_first(y: torch.Tensor, ignore_index: int, chunk: int):
    """``(perm, live)`` for targets ``y`` (N,) in chunks of ``chunk`` tokens: ``perm``
    (int64, N) lists each chunk's token indices with the live ones (``y != ignore_index``)
    first, each group in its original order, chunk after chunk; ``live`` (int32, one per
    chunk) counts each chunk's live tokens. Device ops only: no host sync."""
    n = y.shape[0]
    idx = torch.arange(n, device=y.device)
    ignored = y == ignore_index
    chunk_of = idx // chunk
    # chunk-major keys, live (0) before ignored (1); a stable sort keeps the order within each
    perm = torch.argsort(chunk_of * 2 + ignored, stable=True)
    live = torch.zeros(-(-n // chunk), dtype=torch.int32, device=y.device)
    live.index_add_(0, chunk_of, (~ignored).to(torch.int32))
    return perm, live
