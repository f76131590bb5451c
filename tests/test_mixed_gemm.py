"""The fp16-dz student GEMMs (``logitless.triton_kernels.mixed_gemm``, Gluon, Hopper): built
for sm_90 on any machine (Gluon does not run under the interpreter), and their products
against float64 on a Hopper GPU at shapes that cut every tile, stage and split."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import SEED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mixed_gemm_kernels_compile_for_sm90_without_spills():
    """Every form compiles for sm_90a with both Triton versions the project supports (CI has
    3.7, the GPU machine 3.6), without spills (a whole fp32 tile loaded at once in dW's
    epilogue spilled 2 KB), inside Hopper's 227 KiB of shared memory, and with dW's epilogue
    as one TMA reduce (or store, for the first chunk) per column piece. In a clean process:
    no TRITON_INTERPRET when the kernels are decorated."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = """if True:
        import json
        from logitless.triton_kernels import mixed_gemm as m
        out = {}
        for name, r in m.compile_report().items():
            ptx = r.pop("ptx")
            r["reduce"] = ptx.count("cp.reduce.async.bulk.tensor")
            r["store"] = ptx.count("cp.async.bulk.tensor.2d.global.shared")
            r["wgmma"] = ptx.count("wgmma.mma_async")
            out[name] = r
        out["pieces"] = m.PIECES
        print(json.dumps(out))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    pieces = rep.pop("pieces")
    assert set(rep) == {"dx", "dw-add", "dw-store"}
    for name, form in rep.items():
        assert form["rc"] == 0, (name, form)
        assert any("0 bytes spill stores" in ln for ln in form["ptxas"]), (name, form)
        assert form["shared_bytes"] <= 232448, (name, form)
        assert form["wgmma"] >= 2, (name, form)  # two stages per loop iteration, own A regs
    assert (rep["dw-add"]["reduce"], rep["dw-add"]["store"]) == (pieces, 0)
    assert (rep["dw-store"]["reduce"], rep["dw-store"]["store"]) == (0, pieces)
    assert rep["dx"]["reduce"] == rep["dx"]["store"] == 0


def _hopper():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")


def _operands(c, v, h, seed):
    import torch
    g = torch.Generator(device="cuda").manual_seed(SEED + seed)
    # dz16 in a row-padded buffer, as the JSD's (rows of V rounded up to 16)
    buf = torch.empty(c, -(-v // 16) * 16, dtype=torch.float16, device="cuda")
    dz16 = buf[:, :v]
    dz16.copy_(torch.randn(c, v, generator=g, device="cuda") * 300)
    w = (torch.randn(v, h, generator=g, device="cuda") * 0.02).bfloat16()
    x = torch.randn(c, h, generator=g, device="cuda").bfloat16()
    return dz16, w, x


def _rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("c, v, h", [(384, 1000, 512), (1, 8, 8), (300, 129, 136),
                                     (2048, 4133, 1032), (65, 256, 128)])
@pytest.mark.parametrize("a_scale", [1.0, 2.0 ** -3])
def test_mixed_gemm_products_match_float64(c, v, h, a_scale):
    """dX = s·dz16·fp16(a·W) and dW (= or +=) s·dz16ᵀ·fp16(a·x) against float64 products of
    the same operands: ragged tiles in M, N and K, a K of one stage (odd: the pair's second
    zero-filled), one token, several tiles per program, long K loops (4133: a register set
    overwritten under an in-flight wgmma made errors of 1e-2 to 5); dW added onto what the
    accumulator holds, and both halves of a split accumulator through column slices of dz16
    (as the JSD's split pair); the operand scale's branch (a != 1) and its absence."""
    import torch
    from logitless.triton_kernels import mixed_gemm
    dz16, w, x = _operands(c, v, h, seed=c + v + h)
    s = 2.0 ** -9
    scale, a_t = (torch.tensor([t], device="cuda") for t in (s, a_scale))
    assert mixed_gemm.supported(w, x)
    w16, x16 = ((t.double() * a_scale).half().double() for t in (w, x))
    ref_dx = (dz16.double() @ w16) * s
    out = torch.full((c, h), float("nan"), device="cuda")
    mixed_gemm.dx_(dz16, w, out, scale, a_t)
    assert _rel(out, ref_dx) < 1e-5
    ref_dw = (dz16.double().T @ x16) * s
    acc = torch.full((v, h), float("nan"), device="cuda")
    mixed_gemm.dw_(dz16, x, acc, scale, a_t, first=True)  # assigns: the NaNs are gone
    assert _rel(acc, ref_dw) < 1e-5
    base = torch.randn(v, h, device="cuda")
    acc.copy_(base)
    mixed_gemm.dw_(dz16, x, acc, scale, a_t, first=False)
    assert _rel(acc, base.double() + ref_dw) < 1e-5
    r1 = -(-((v + 1) // 2) // 8) * 8  # the split pair's first rows (narrow_cast.split_rows)
    if r1 < v:
        top = torch.zeros(r1, h, device="cuda")
        bottom = torch.zeros(v - r1, h, device="cuda")
        mixed_gemm.dw_(dz16[:, :r1], x, top, scale, a_t, first=False)
        mixed_gemm.dw_(dz16[:, r1:], x, bottom, scale, a_t, first=True)
        assert _rel(torch.cat([top, bottom]), ref_dw) < 1e-5


@hopper
@pytest.mark.gpu
def test_mixed_gemm_supported_names_what_it_takes():
    import torch
    from logitless.triton_kernels import mixed_gemm
    dz16, w, x = _operands(16, 64, 32, seed=1)
    assert mixed_gemm.supported(w, x)
    assert not mixed_gemm.supported(w.half(), x)
    assert not mixed_gemm.supported(w.t().contiguous().t(), x)  # columns not contiguous
    w12 = torch.zeros(64, 12, dtype=torch.bfloat16, device="cuda")
    assert not mixed_gemm.supported(w12, x[:, :12])  # H not a multiple of 8
    assert not mixed_gemm.supported(w.cpu(), x.cpu())


@pytest.mark.parametrize("n, dtype", [(1, "bfloat16"), (4097, "float32"), (200003, "bfloat16"),
                                      (65536 * 3, "float16")])
def test_abs_max_is_exact(n, dtype):
    """The fp16-dz range check's ``max |t|``: exactly torch's, across several programs (65536
    elements each), a ragged end, the largest value negative; a NaN anywhere gives NaN; an
    empty tensor 0."""
    import torch
    from logitless.triton_kernels.abs_max import abs_max
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(SEED + n)
    t = torch.randn(n, generator=g).to(dev, getattr(torch, dtype))
    t[n // 2] = -9.5
    assert abs_max(t).item() == t.float().abs().max().item() == 9.5
    t[-1] = float("nan")
    assert torch.isnan(abs_max(t)).all()
    assert abs_max(t[:0]).item() == 0.0
