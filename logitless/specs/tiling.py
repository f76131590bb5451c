"""Chunk planning from a memory budget: a pure function, so every backend chunks alike.

A fused linear loss walks the tokens in chunks; each chunk materializes at most a
``[chunk, V]`` block of logits (or of logit gradients). The plan picks the largest chunk whose
block fits ``budget_bytes``, rounded down to a multiple of ``multiple`` (GEMM-friendly), and
never below ``min_chunk`` (one chunk must exist even when the budget is tiny).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

# Default budget for the one [chunk, V] logits block a fused loss may hold at a time.
# 1 GiB keeps the Llama-3 shape (V = 128256) at 4096 bf16 tokens per chunk: big enough that
# the chunked GEMMs run at the unchunked rate (TARGETS.md), small next to the fp32 dW.
DEFAULT_BUDGET_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    n: int
    chunk: int

    @property
    def num_chunks(self) -> int:
        return max(1, -(-self.n // self.chunk))

    def bounds(self):
        """(start, stop) of each chunk, the last one possibly short."""
        return [(s, min(s + self.chunk, self.n)) for s in range(0, max(self.n, 1), self.chunk)]


def plan_token_chunks(n: int, v: int, *, bytes_per_element: int,
                      budget_bytes: Optional[int] = None, chunk_size: Optional[int] = None,
                      multiple: int = 128, min_chunk: int = 16) -> ChunkPlan:
    """Tokens per chunk so that one ``[chunk, V]`` block of ``bytes_per_element`` fits the budget.

    ``chunk_size`` (a user's explicit choice) wins over the budget. The result never exceeds
    ``n`` (a single chunk covers small problems exactly).
    """
    for name, val in (("n", n), ("v", v), ("bytes_per_element", bytes_per_element)):
        if not isinstance(val, int) or val < (0 if name == "n" else 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    # the user's values: any integer type (a NumPy int too, as a Python int), never a bool
    for name, val in (("chunk_size", chunk_size), ("memory_budget", budget_bytes)):
        if getattr(val, "shape", None) == () and not _is_integer(val):  # 0-d array, traced
            from .linear_cross_entropy import not_static
            raise not_static(name, val, "an int")
    if chunk_size is not None:
        if not _is_integer(chunk_size) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return ChunkPlan(n=n, chunk=max(1, min(int(chunk_size), max(n, 1))))
    budget = DEFAULT_BUDGET_BYTES if budget_bytes is None else budget_bytes
    if not _is_integer(budget) or budget < 1:
        raise ValueError(f"memory_budget must be a positive int (bytes), got {budget_bytes!r}")
    budget = int(budget)
    chunk = budget // (v * bytes_per_element)
    if chunk >= multiple:
        chunk = (chunk // multiple) * multiple
    chunk = max(min_chunk, chunk)
    return ChunkPlan(n=n, chunk=max(1, min(chunk, max(n, 1))))


# Half-precision GEMM libraries (cuBLAS, XLA's GPU GEMMs) take their fast tensor-core kernels
# only when every leading dimension is a multiple of 8 elements (16 bytes). A vocabulary like
# GPT-2's 50257 puts V on a leading dimension of the logits and their gradient, and every GEMM
# of the op then runs 2-4x slower (H100). The PyTorch backends run their GEMMs over the
# vocabulary in parts (:func:`vocab_parts`: the aligned bulk, and the few classes past it) into
# buffers whose rows are padded; the JAX drivers, which cannot pad a buffer's rows, pad the
# vocabulary itself (:func:`padded_vocab`).
VOCAB_ALIGN = 8


def vocab_parts(v: int):
    """Vocabulary ranges ``(start, stop)`` the GEMMs run over: ``(0, v)`` alone when ``v`` is a
    multiple of :data:`VOCAB_ALIGN` (or below it), else the aligned bulk and the rest."""
    bulk = v - v % VOCAB_ALIGN
    return ((0, v),) if bulk in (0, v) else ((0, bulk), (bulk, v))


def padded_vocab(v: int) -> int:
    """``v`` rounded up to a multiple of :data:`VOCAB_ALIGN`."""
    return -(-v // VOCAB_ALIGN) * VOCAB_ALIGN


BALANCE_MULTIPLE = 8  # balanced chunk sizes are multiples of this: padding adds fewer per chunk


def balanced(plan: ChunkPlan, multiple: int = BALANCE_MULTIPLE) -> ChunkPlan:
    """The same number of chunks, of nearly equal sizes: the smallest multiple of ``multiple``
    that covers n in ``plan.num_chunks`` chunks (n = 8192 in chunks of 1792: 5 × 1640 instead
    of 4 × 1792 + 1024), so that padding n to whole chunks adds under ``multiple`` tokens per
    chunk. Never larger than ``plan.chunk`` (the plan is returned as is where it would be)."""
    k = plan.num_chunks
    chunk = ceil_div(ceil_div(plan.n, k), multiple) * multiple
    return plan if k <= 1 or chunk > plan.chunk else ChunkPlan(n=plan.n, chunk=chunk)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()  # exact for any int (no float log2)
