"""Data-parallel normalisation: the global token count, all-reduced on device.

Under data parallelism (DDP, FSDP2) and gradient accumulation, ``reduction="mean"`` averages
over each rank's micro-batch, which weights tokens unequally when micro-batches hold different
numbers of non-ignored tokens. The global-token mean is::

    count = global_token_count(torch.cat([mb_targets for mb_targets in micro_batches]),
                               process_group=dp_group)           # once per optimizer step
    for mb in micro_batches:
        loss = linear_cross_entropy(h, W, mb_targets, reduction="sum") / count
        (loss * dp_world_size).backward()  # DDP / FSDP2 *average* gradients over ranks

so that the accumulated gradient is that of Σ_tokens loss / Σ_tokens 1 over every rank and
micro-batch. ``count`` stays on the device (no ``.item()``): the all-reduce is enqueued on the
current stream, so nothing waits on the host.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._torch_common import check_targets, widen_targets

__all__ = ["global_token_count"]


def global_token_count(target, ignore_index: int = -100, *, weight=None, process_group=None):
    """Σ over ranks of the non-ignored tokens of ``target`` (or of their class weights
    ``weight[target]``, the "mean" denominator with class weights), as a float32 (float64 if
    ``weight`` is) 0-d tensor on ``target``'s device, all-reduced over ``process_group``
    (the default group when torch.distributed is initialized, else no reduction).

    With ``weight``, a label outside ``[0, len(weight))`` that is not ``ignore_index`` is an
    error (a device-side assert on CUDA, a ``RuntimeError`` on CPU), as in the loss.

    It is at least 1 only if some token counts: a batch whose tokens are all ignored
    everywhere gives 0, so divide by ``count.clamp_min(1)`` if that can happen.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.is_floating_point() or target.dtype == torch.bool or target.is_complex():
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    # widened as the loss widens them: compared in uint8, ignore_index=-100 would wrap to 156,
    # and the valid class 156 would go uncounted
    target = widen_targets(target, ignore_index)
    mask = target != ignore_index
    if weight is None:
        count = mask.sum(dtype=torch.float32)
    else:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 1:
            raise TypeError("weight (class weights) must be a 1-D floating torch.Tensor")
        # a stray label (e.g. -1) would otherwise read weight[-1]: an error, as in the loss
        check_targets(target, weight.shape[0], ignore_index)
        safe = torch.where(mask, target, torch.zeros_like(target))
        dt = torch.float64 if weight.dtype == torch.float64 else torch.float32
        count = (weight.to(dt)[safe] * mask).sum()
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("process_group was given but torch.distributed is not initialized")
        dist.all_reduce(count, group=process_group)
    return count
