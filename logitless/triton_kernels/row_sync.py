"""Programs of one launch that wait for each other: the per-row barrier of the row kernels
whose rows are split over programs (CE: :mod:`.cross_entropy_rows`, JSD: :mod:`.jsd_rows`).
A launch hands out (row, segment) tickets in order from an atomic counter, so at most one row
is ever incomplete and it cannot deadlock while a row's segments can all be resident."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_row(cnt_ptr, abort_ptr, target, MAX_SPIN: tl.constexpr):
    """Arrive at a row's counter and wait until ``target`` arrivals: True unless timed out (or
    an earlier wait of the launch did). The barrier orders this program's partial stores
    before the release; the acquire polls (one thread each, result broadcast: the loop
    condition is uniform) order the other segments' stores before our (L1-bypassing) loads
    of them. A timeout raises the launch's abort flag, so that later rows give up at once
    instead of each waiting MAX_SPIN polls."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    spins = tl.where(tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="gpu") != 0, MAX_SPIN, 0)
    while (c < target) & (spins < MAX_SPIN):
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    ok = c >= target
    if not ok:
        tl.atomic_xchg(abort_ptr, 1, sem="relaxed", scope="gpu")
    # Once any wait of the launch has timed out, every later result is poisoned too: where a
    # row has two barriers on one counter (the JSD), a timed-out segment's second arrival can
    # complete a peer's first barrier over partials that were never written (finite, wrong
    # results). The timed-out program raises the flag before its release arrival, so a peer
    # whose acquire saw that arrival sees the flag.
    return ok & (tl.atomic_add(abort_ptr, 0, sem="acquire", scope="gpu") == 0)
