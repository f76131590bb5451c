"""Small Triton kernels that run a kernel module's ``@triton.jit`` helpers on their own, for
tests of those helpers (a kernel must be defined at a module's top level: it sees only
globals). Imported only where Triton is installed."""
import triton
import triton.language as tl

from logitless.triton_kernels import jsd_rows


@triton.jit
def lam_roundtrip(lam_ptr, slot_ptr, back_ptr, n, lo, BLOCK: tl.constexpr):
    """``jsd_rows._lam_encode`` of ``n`` fp32 Λ values: the 16-bit slots and the decoded Λ."""
    i = tl.arange(0, BLOCK)
    m = i < n
    slot, back = jsd_rows._lam_encode(tl.load(lam_ptr + i, mask=m), lo)
    tl.store(slot_ptr + i, slot, mask=m)
    tl.store(back_ptr + i, back, mask=m)
