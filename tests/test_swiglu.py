"""The fused SwiGLU ``silu(gate) * up`` (forward and backward) against the float64 spec, on
both sides: the Triton kernel (interpreted on CPU) and its torch fallback, the Pallas kernel
(interpret mode on CPU) and its XLA twin; and torch vs JAX on the very same inputs.

Tolerance: the shared harness's rule (``harness.compare``), each output's relative error
against float64 within ``FACTOR`` × the naive path's (``F.silu(g) * u`` / ``jax.nn.silu(g) * u``
in the input dtype, which round twice), never below the dtype's floor. The kernels compute in
fp32 and round once.
"""
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jax
import jax.numpy as jnp

import logitless.jax as lj
import logitless.torch as lt
from harness import FLOOR, NP_DTYPES, SEED, compare, rel_err
from logitless import tiled_mlp_torch
from logitless.specs import tiled_mlp as spec
from logitless.triton_kernels import swiglu as tk

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DTYPES = ("float32", "bfloat16", "float16")
SHAPES = [(37, 97), (1, 1), (3, 5, 1031)]  # odd, a single element, 3-D with prime cols
# Small tiles: a grid of several row and column blocks, ragged at both ends.
SMALL_TILES = dict(block_rows=4, block_cols=32)


def _inputs(shape, dtype, salt=0):
    """gate, up, dh rounded to ``dtype`` (float32 arrays holding the rounded values). Gates
    span ±8 so both tails of the sigmoid are exercised."""
    rng = np.random.default_rng([SEED, salt, zlib.crc32(f"{shape}{dtype}".encode())])
    dt = NP_DTYPES[dtype]
    r = lambda scale: (rng.standard_normal(shape) * scale).astype(dt).astype(np.float32)
    return r(3.0), r(1.0), r(1.0)


def _reference(g, u, dh):
    h = spec.swiglu(g, u)
    dg, du = spec.swiglu_grad(dh, g, u)
    return dict(h=h, dg=dg, du=du)


def _torch_run(fn, g, u, dh, dtype):
    t = lambda a: torch.tensor(a, dtype=getattr(torch, dtype), device=DEV).requires_grad_()
    gt, ut = t(g), t(u)
    h = fn(gt, ut)
    h.backward(torch.tensor(dh, dtype=h.dtype, device=DEV))
    f = lambda a: a.detach().double().cpu().numpy()
    return dict(h=f(h), dg=f(gt.grad), du=f(ut.grad))


def _jax_run(fn, g, u, dh, dtype):
    a = lambda v: jnp.asarray(v, jnp.dtype(dtype))
    h, vjp = jax.vjp(fn, a(g), a(u))
    dg, du = vjp(a(dh))
    f = lambda v: np.asarray(v, np.float64)
    return dict(h=f(h), dg=f(dg), du=f(du))


def _naive_torch(g, u):
    return F.silu(g) * u


def _naive_jax(g, u):
    # each op's result rounded to the dtype, as a GPU materializes it (XLA on CPU may not)
    fi = jnp.finfo(g.dtype)
    rp = lambda a: jax.lax.reduce_precision(a, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return rp(rp(jax.nn.silu(g)) * u)


TORCH_IMPLS = {"triton": tk.swiglu, "torch-fallback": tiled_mlp_torch._SwiGLUTorch.apply}
JAX_IMPLS = {"pallas": lambda g, u: lj.swiglu(g, u, backend="pallas"),
             "xla": lambda g, u: lj.swiglu(g, u, backend="xla")}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_swiglu_matches_float64(shape, dtype):
    g, u, dh = _inputs(shape, dtype)
    ref = _reference(g, u, dh)
    naive = _torch_run(_naive_torch, g, u, dh, dtype)
    for name, fn in TORCH_IMPLS.items():
        if name != "triton" and shape != SHAPES[0]:
            continue  # the same math in plain ops: one shape is enough
        out = _torch_run(fn, g, u, dh, dtype)
        compare(dtype, out, ref, naive)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_jax_swiglu_matches_float64(shape, dtype):
    g, u, dh = _inputs(shape, dtype)
    ref = _reference(g, u, dh)
    naive = _jax_run(_naive_jax, g, u, dh, dtype)
    for name, fn in JAX_IMPLS.items():
        if name != "pallas" and shape != SHAPES[0]:
            continue  # the same math in jnp: one shape is enough
        out = _jax_run(jax.jit(fn), g, u, dh, dtype)
        compare(dtype, out, ref, naive)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_and_jax_kernels_agree(dtype):
    """Triton vs Pallas on the same inputs: the same fp32 math (their sigmoids differ by a
    few fp32 ulps), rounded once. Elementwise, d gate may differ relatively more where
    silu'(g) crosses 0 (cancellation), so the check is on the norm: a fraction of an ulp of
    the output dtype (rounding flips on a few elements), a few fp32 ulps."""
    g, u, dh = _inputs((29, 300), dtype, salt=1)
    a = _torch_run(tk.swiglu, g, u, dh, dtype)
    b = _jax_run(JAX_IMPLS["pallas"], g, u, dh, dtype)
    eps = float(ml_dtypes.finfo(NP_DTYPES[dtype]).eps)
    for key in a:
        diff = rel_err(a[key], b[key])
        assert diff <= (4 * eps if dtype == "float32" else eps / 4), f"{key}: {diff:.3g}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_tiles_ragged_grid(dtype):
    g, u, dh = _inputs((37, 97), dtype, salt=5)
    ref = _reference(g, u, dh)
    naive = _torch_run(_naive_torch, g, u, dh, dtype)

    def triton_small(a, b):
        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, b):
                ctx.save_for_backward(a, b)
                return tk.swiglu_forward(a, b, **SMALL_TILES)

            @staticmethod
            def backward(ctx, dh):
                return tk.swiglu_backward(dh, *ctx.saved_tensors, **SMALL_TILES)
        return Fn.apply(a, b)

    compare(dtype, _torch_run(triton_small, g, u, dh, dtype), ref, naive)
    pallas_small = lambda a, b: lj.swiglu(a, b, backend="pallas", **SMALL_TILES)
    compare(dtype, _jax_run(jax.jit(pallas_small), g, u, dh, dtype), ref, naive)


@pytest.mark.parametrize("shape", [(1, 200_000_000), (8, 2**27 + 2048), (131072, 28672)])
def test_triton_grid_stays_inside_cuda_limits(shape, monkeypatch):
    """One grid axis of row tiles × column tiles: a flattened gate wider than 65535 column
    tiles (134M elements) or 65536 row tiles must not pass CUDA's 65535 of a second or third
    axis (the launch would fail with "invalid argument"). The GPU's tile sizes, also when
    interpreted."""
    monkeypatch.setattr(tk, "_INTERPRET", False)
    grid, meta = tk._launch_config(*shape, None, None, None)
    assert len(grid) == 1 and 1 <= grid[0] <= 2**31 - 1
    rows, cols = shape
    assert grid[0] == -(-rows // meta["BLOCK_R"]) * -(-cols // meta["BLOCK_C"])


def test_triton_strided_views_and_in_place_outputs():
    """gate/up as the two halves of one [rows, 2I] projection (row-strided views, no copies);
    the backward written over gate and up themselves."""
    g, u, dh = _inputs((19, 77), "float32", salt=2)
    both = torch.tensor(np.concatenate([g, u], axis=1), device=DEV)
    gv, uv = both[:, :77], both[:, 77:]
    assert not gv.is_contiguous()
    ref = _reference(g, u, dh)
    h = tk.swiglu_forward(gv, uv)
    close = lambda a, r: rel_err(a.cpu().numpy(), r) <= FLOOR["float32"]
    assert close(h, ref["h"])
    dht = torch.tensor(dh, device=DEV)
    dg, du = tk.swiglu_backward(dht, gv, uv, grad_gate=gv, grad_up=uv)
    assert dg.data_ptr() == gv.data_ptr() and du.data_ptr() == uv.data_ptr()
    assert close(both[:, :77], ref["dg"]) and close(both[:, 77:], ref["du"])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_double_backward(dtype):
    """create_graph=True through lt.swiglu (the Triton op for float32 — interpreted off a
    GPU — and the torch formula for float64) gives float64 autograd's second derivatives."""
    g, u, dh = _inputs((5, 33), "float32", salt=9)
    t = lambda a, dt: torch.tensor(a, dtype=dt, device=DEV).requires_grad_()

    def second(fn, dt):
        gate, up, dht = t(g, dt), t(u, dt), torch.tensor(dh, dtype=dt, device=DEV)
        dg, du = torch.autograd.grad(fn(gate, up), (gate, up), dht, create_graph=True)
        return torch.autograd.grad((dg * dg).sum() + (du * up).sum(), (gate, up))
    want = second(lambda a, b: torch.nn.functional.silu(a) * b, torch.float64)
    got = second(lt.swiglu, getattr(torch, dtype))
    for a, b in zip(got, want):
        assert rel_err(a.double().cpu().numpy(), b.cpu().numpy()) < 1e-5


def test_nan_propagates():
    g = torch.tensor([[0.5, float("nan"), -2.0]], device=DEV)
    u = torch.ones_like(g)
    h = lt.swiglu(g, u)
    assert torch.isnan(h[0, 1]) and torch.isfinite(h[0, [0, 2]]).all()
    hj = lj.swiglu(jnp.asarray(g.cpu().numpy()), jnp.ones((1, 3)), backend="pallas")
    assert np.isnan(hj[0, 1]) and np.isfinite(np.asarray(hj)[0, [0, 2]]).all()


def test_front_doors_pick_an_implementation():
    g, u, _ = (a.astype(np.float64) for a in _inputs((5, 7), "float32"))
    # float64 (no Triton kernel): the torch formula, computed in float64
    gt, ut = torch.tensor(g), torch.tensor(u)
    np.testing.assert_allclose(lt.swiglu(gt, ut).numpy(), spec.swiglu(g, u), rtol=1e-15)
    gt, ut = gt.float().to(DEV), ut.float().to(DEV)
    torch.testing.assert_close(lt.swiglu(gt, ut), tk.swiglu(gt, ut), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_backward_leaves_the_incoming_gradient_alone(dtype, monkeypatch):
    """The torch-formula backward (float64, or no Triton) must not write into grad_h: autograd
    hands the same tensor to other branches (a residual add), or an expanded one (``.sum()``)."""
    monkeypatch.setattr(tiled_mlp_torch, "_triton_swiglu", None)  # the formula for fp32 too
    g, u, _ = (torch.tensor(a, dtype=dtype) for a in _inputs((6, 9), "float32", salt=4))
    w = torch.randn(9, dtype=dtype, generator=torch.Generator().manual_seed(SEED))
    ga, ua, wa = (t.clone().requires_grad_() for t in (g, u, w))
    (lt.swiglu(ga, ua) + wa).pow(2).sum().backward()  # one grad tensor for both branches
    gb, ub, wb = (t.clone().requires_grad_() for t in (g, u, w))
    (F.silu(gb) * ub + wb).pow(2).sum().backward()
    def close(got, want):
        # element-wise to 1e-12 (float64) / 1e-5, plus a few ulps of the largest gradient,
        # since silu' crosses 0 (at g = -1.28): there the two formulas' few-ulp differences of
        # O(1) terms are large relative to the result (float32, seed 235401254: 2e-9 absolute,
        # 1.3e-5 relative; float64, seed 269562280: 6e-18 absolute, 1.1e-12 relative)
        torch.testing.assert_close(got, want, rtol=1e-12 if dtype == torch.float64 else 1e-5,
                                   atol=4 * torch.finfo(dtype).eps * want.abs().max().item())

    for a, b in ((ga, gb), (ua, ub), (wa, wb)):
        close(a.grad, b.grad)
    gc, uc = g.clone().requires_grad_(), u.clone().requires_grad_()
    lt.swiglu(gc, uc).sum().backward()  # an expanded (stride-0) gradient
    gd, ud = g.clone().requires_grad_(), u.clone().requires_grad_()
    (F.silu(gd) * ud).sum().backward()
    close(gc.grad, gd.grad)


def test_torch_compile_traces_the_op():
    g, u, dh = (torch.tensor(a, device=DEV) for a in _inputs((8, 40), "float32", salt=3))
    compiled = torch.compile(lambda a, b: lt.swiglu(a, b) * 2.0, backend="aot_eager",
                             fullgraph=True)
    ga, ua = g.clone().requires_grad_(), u.clone().requires_grad_()
    compiled(ga, ua).backward(dh)
    gb, ub = g.clone().requires_grad_(), u.clone().requires_grad_()
    (lt.swiglu(gb, ub) * 2.0).backward(dh)
    torch.testing.assert_close(ga.grad, gb.grad, rtol=0, atol=0)
    torch.testing.assert_close(ua.grad, ub.grad, rtol=0, atol=0)


@pytest.mark.parametrize("bad, exc, message", [
    (dict(up=torch.ones(3, 5)), ValueError, "up has shape"),
    (dict(up=torch.ones(3, 4, dtype=torch.float64)), TypeError, "up dtype"),
    (dict(gate=torch.ones(3, 4, dtype=torch.int32)), TypeError, "gate must be a floating"),
    (dict(up=np.ones((3, 4))), TypeError, "up must be a torch.Tensor"),
])
def test_torch_bad_arguments(bad, exc, message):
    args = {**dict(gate=torch.ones(3, 4), up=torch.ones(3, 4)), **bad}
    with pytest.raises(exc, match=message):
        lt.swiglu(args["gate"], args["up"])


def test_jax_bad_arguments():
    with pytest.raises(ValueError, match="up has shape"):
        lj.swiglu(jnp.ones((3, 4)), jnp.ones((3, 5)))
    with pytest.raises(ValueError, match="block_cols must be a power of two"):
        lj.swiglu(jnp.ones((3, 4)), jnp.ones((3, 4)), backend="pallas", block_cols=48)
    with pytest.raises(ValueError, match="backend must be"):
        lj.swiglu(jnp.ones((3, 4)), jnp.ones((3, 4)), backend="triton")
    with pytest.raises(TypeError, match=r"backend='pallas'.*did you mean 'block_rows'"):
        lj.swiglu(jnp.ones((3, 4)), jnp.ones((3, 4)), backend="pallas", block_row=4)


def test_jax_xla_second_order_matches_float64():
    """backend="xla" has every second-order derivative, forward-over-reverse included
    (jax.hessian, the jvp of a gradient: its custom_vjp's rules had called the custom_vjp
    function itself, which the outer JVP refused), equal to float64 autodiff of the formula."""
    g, u, _ = _inputs((3, 5), "float32", salt=11)
    f = lambda fn: (lambda a, b: jnp.sum(fn(a, b) ** 2 * b))
    plain = f(lambda a, b: jax.nn.silu(a) * b)
    ours = f(lambda a, b: lj.swiglu(a, b, backend="xla"))
    with jax.enable_x64(True):
        want = jax.hessian(plain, argnums=(0, 1))(jnp.asarray(g, jnp.float64),
                                                  jnp.asarray(u, jnp.float64))
    got = jax.hessian(ours, argnums=(0, 1))(jnp.asarray(g), jnp.asarray(u))
    for gr, wr in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(np.asarray(gr, np.float64), np.asarray(wr)) < 1e-5
    hvp = jax.jvp(jax.grad(ours), (jnp.asarray(g), jnp.asarray(u)),
                  (jnp.ones_like(g), jnp.zeros_like(u)))[1]
    assert rel_err(np.asarray(hvp, np.float64), np.asarray(want[0][0]).sum(axis=(2, 3))) < 1e-5


def test_pallas_lowers_to_triton_at_the_target_shape():
    """The Pallas kernels lower through the Triton backend for CUDA with the GPU defaults at
    the Llama-3-8B MLP shape (T=32768, I=14336, bf16); no GPU needed, nothing allocated."""
    s = jax.ShapeDtypeStruct((32768, 14336), jnp.bfloat16)

    def f(g, u):
        return jnp.sum(lj.swiglu(g, u, backend="pallas", interpret=False).astype(jnp.float32))

    traced = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(s, s)
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("xla.gpu.triton") >= 2  # forward and backward kernels


@gpu
def test_gpu_large_rows_and_inductor():
    g, u, dh = (torch.tensor(a, device="cuda", dtype=torch.bfloat16)
                for a in _inputs((4096, 14336), "bfloat16", salt=4))
    ref = _reference(*(a.float().cpu().numpy() for a in (g, u, dh)))
    out = _torch_run(tk.swiglu, *(a.float().cpu().numpy() for a in (g, u, dh)), "bfloat16")
    naive = _torch_run(_naive_torch, *(a.float().cpu().numpy() for a in (g, u, dh)), "bfloat16")
    compare("bfloat16", out, ref, naive)
    compiled = torch.compile(lambda a, b: lt.swiglu(a, b), fullgraph=True)
    torch.testing.assert_close(compiled(g, u), lt.swiglu(g, u), rtol=0, atol=0)
