"""The DLPack bridge: zero copy (pointer equality) both ways, every explicit-copy case, the
generic JAX-function-as-autograd-op wrapper against torch autograd, the JAX memory policy,
and (GPU) stream ordering proven by a race that appears when the handshake is switched off.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import logitless.bridge as bridge  # noqa: E402
from logitless.bridge import JaxFunction, ZeroCopyError, to_jax, to_torch, would_copy  # noqa: E402
from logitless.bridge import dlpack as bdl  # noqa: E402

from harness import SEED  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)


def rand(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def ptr(a):
    return a.unsafe_buffer_pointer()


def as_np(t):
    return t.detach().float().cpu().numpy()


# ------------------------------------------------------------------------- zero copy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_torch_to_jax_to_torch_shares_memory(gen, device, dtype):
    t = rand(gen, 37, 33, dtype=dtype, device=device)
    assert would_copy(t) is None
    a = to_jax(t, copy=False)
    assert a.dtype == jnp.dtype(str(dtype).removeprefix("torch.")) and a.shape == (37, 33)
    assert ptr(a) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a, np.float32), as_np(t))
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype and back.device == t.device
    if device == "cpu":  # shared, not equal-by-value: a write on one side shows on the other
        t.add_(1)
        np.testing.assert_array_equal(np.asarray(a, np.float32), as_np(t))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_jax_outputs_to_torch_share_memory(gen, device, dtype):
    """A JAX-computed array (as the bridge's forward/backward outputs are) crosses zero-copy."""
    src = rand(gen, 19, 7, device=device)
    a = jax.jit(lambda v: jnp.tanh(v).astype(str(dtype).removeprefix("torch.")))(to_jax(src))
    t = to_torch(a, copy=False)
    assert t.data_ptr() == ptr(a) and t.dtype == dtype and tuple(t.shape) == a.shape
    np.testing.assert_array_equal(as_np(t), np.asarray(a, np.float32))
    assert ptr(to_jax(t, copy=False)) == ptr(a)  # and straight back
    copied = to_torch(a, copy=True)
    assert copied.data_ptr() != ptr(a) and torch.equal(copied, t)


def test_transposed_is_zero_copy_with_its_layout(gen):
    base = rand(gen, 33, 37)
    t = base.t()
    assert not t.is_contiguous() and would_copy(t) is None
    a = to_jax(t, copy=False)
    assert ptr(a) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    # jit compiles for that layout: results are right
    np.testing.assert_allclose(np.asarray(jax.jit(lambda v: v @ v.T)(a)), (t @ t.T).numpy(),
                               rtol=1e-5, atol=1e-5)
    assert to_torch(a).stride() == t.stride()


def test_requires_grad_is_detached_not_copied(gen):
    t = rand(gen, 8, 5).requires_grad_()
    assert would_copy(t) is None
    a = to_jax(t, copy=False)
    assert ptr(a) == t.data_ptr()
    assert t.requires_grad  # the caller's tensor is untouched


# --------------------------------------------------------------------- explicit copies
def _copy_case(name, gen):
    if name == "step-sliced":
        t = rand(gen, 10, 12)[:, ::2]
        return t, t.numpy(), "dense layout"
    if name == "misaligned":
        t = rand(gen, 200)[1:]  # 4-byte offset from an aligned allocation
        return t, t.numpy(), "aligned"
    if name == "broadcast":
        t = rand(gen, 1, 6).expand(4, 6)  # stride 0, e.g. the gradient of .sum()
        return t, t.numpy(), "dense layout"
    if name == "int64":
        t = torch.randint(-100, 5000, (64,), generator=gen)
        return t, t.numpy().astype(np.int32), "int32"
    if name == "negative-bit":
        t = torch.randn(6, dtype=torch.complex64, generator=gen).conj().imag
        return t, t.resolve_neg().numpy(), "negative bit"
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["step-sliced", "misaligned", "broadcast", "int64", "negative-bit"])
def test_copy_cases_are_explicit(gen, name):
    t, expected, words = _copy_case(name, gen)
    reason = would_copy(t)
    assert reason is not None and words in reason
    with pytest.raises(ZeroCopyError, match=words):
        to_jax(t, copy=False)
    a = to_jax(t)  # copy=None: the documented copy, with the right values
    assert ptr(a) != t.data_ptr() and ptr(a) % bdl.ALIGNMENT == 0
    assert np.asarray(a).dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(a), expected)


def test_copy_true_always_copies(gen):
    t = rand(gen, 16, 4)
    a = to_jax(t, copy=True)
    assert ptr(a) != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_aligned_slice_stays_zero_copy(gen):
    base = rand(gen, 4, 64)   # rows of 256 bytes: every row start is 64-byte aligned
    t = base[1:]
    assert would_copy(t) is None and ptr(to_jax(t, copy=False)) == t.data_ptr()


def test_int64_out_of_int32_range_is_an_error():
    t = torch.tensor([3, 2**31, -100])
    with pytest.raises(RuntimeError, match="does not fit"):
        to_jax(t)


def test_uint64_is_narrowed_after_a_range_check():
    """uint64 -> uint32 as the copy table says (PyTorch has no uint64 comparison kernels: the
    range check failed with NotImplementedError "ge_cpu" for every uint64 tensor)."""
    t = torch.tensor([0, 1, 7, 2**32 - 1], dtype=torch.uint64)
    a = to_jax(t)
    assert a.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(a), np.array([0, 1, 7, 2**32 - 1], np.uint32))
    for big in (2**32, 2**63 + 5):  # the second is negative seen as int64
        with pytest.raises(RuntimeError, match="does not fit"):
            to_jax(torch.tensor([3, big], dtype=torch.uint64))


def test_int64_with_x64_is_zero_copy():
    t = torch.arange(10)
    with jax.enable_x64(True):
        assert would_copy(t) is None
        a = to_jax(t, copy=False)
        assert a.dtype == jnp.int64 and ptr(a) == t.data_ptr()


def test_float64_without_x64_is_refused(gen):
    with pytest.raises(TypeError, match="x64"):
        to_jax(rand(gen, 3).double())


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.Tensor"):
        to_jax(np.ones(3))
    with pytest.raises(TypeError, match="jax.Array"):
        to_torch(torch.ones(3))
    with pytest.raises(TypeError, match="jax.jit"):
        jax.jit(lambda v: to_torch(v))(jnp.ones(3))


# ------------------------------------------------------------------ JaxFunction (autograd)
def _jax_ce(x, w, y, bias, *, scale):
    """Per-token cross-entropy of x @ w.T + bias, and the lse; ints in (y), an int out."""
    z = x @ w.T + bias
    lse = jax.nn.logsumexp(z.astype(jnp.float32), axis=1)
    z_y = jnp.take_along_axis(z, y[:, None], axis=1)[:, 0].astype(jnp.float32)
    return scale * (lse - z_y), lse, jnp.argmax(z, axis=1)


def _torch_ce(x, w, y, bias, *, scale):
    z = x @ w.T + bias
    lse = torch.logsumexp(z.float(), dim=1)
    return scale * (lse - z.gather(1, y[:, None])[:, 0].float()), lse, z.argmax(1)


def _leaves(gen, dtype=torch.float32):
    x = rand(gen, 9, 6, dtype=dtype).requires_grad_()
    w = rand(gen, 11, 6, dtype=dtype).requires_grad_()
    b = rand(gen, 11, dtype=dtype).requires_grad_()
    y = torch.randint(0, 11, (9,), generator=gen)
    return x, w, b, y


def _grads(outs, ins, cts):
    pairs = [(o, c) for o, c in zip(outs, cts) if c is not None]
    return torch.autograd.grad([o for o, _ in pairs], ins, [c for _, c in pairs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("used", ["both", "loss-only", "lse-only"])
def test_jax_function_matches_torch_autograd(gen, dtype, used):
    op = JaxFunction(_jax_ce)
    x, w, b, y = _leaves(gen, dtype)
    loss, lse, am = op(x, w, y, b, scale=1.5)
    ref_loss, ref_lse, ref_am = _torch_ce(x, w, y, b, scale=1.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, r in ((loss, ref_loss), (lse, ref_lse)):
        _assert_matches(a, r, dtype, tol)
    assert torch.equal(am.long(), ref_am) and not am.requires_grad
    assert loss.requires_grad and lse.requires_grad and loss.dtype == torch.float32
    g, h = rand(gen, 9), rand(gen, 9)
    cts = {"both": (g, h), "loss-only": (g, None), "lse-only": (None, h)}[used]
    got = _grads((loss, lse), (x, w, b), cts)
    want = _grads((ref_loss, ref_lse), (x, w, b), cts)
    for a, r in zip(got, want):
        assert a.dtype == r.dtype and a.shape == r.shape
        _assert_matches(a, r, dtype, tol)


def _assert_matches(a, r, dtype, tol):
    """fp32: elementwise. bf16: each framework rounds its own logits (XLA may fuse the bias add
    before rounding, PyTorch rounds twice), so a single value may stray by a bf16 ulp of the
    logits (0.03 at |z| ~ 4, a 3% change of that softmax term); the whole vector must agree
    to a few bf16 ulps: over 300 seeds the worst of these norms was 2.4e-2 of the reference's
    (the 2e-2 this had failed about one seed in 300), and a wrong scale or term is O(1)."""
    if dtype == torch.float32:
        np.testing.assert_allclose(as_np(a), as_np(r), **tol)
        return
    a64, r64 = as_np(a).astype(np.float64), as_np(r).astype(np.float64)
    assert np.isfinite(a64).all()
    assert np.linalg.norm(a64 - r64) <= 4e-2 * np.linalg.norm(r64)


def test_jax_function_compiles_once_per_config(gen):
    traces = []

    def f(x, w, *, k):
        traces.append(k)
        return jnp.sum(jnp.sin(x @ w.T)) * k

    op = JaxFunction(f)
    for _ in range(3):
        x, w, _, _ = _leaves(gen)
        op(x, w, k=2.0).backward()
    assert len(op._plans) == 1
    n = len(traces)
    op(x, w, k=3.0).backward()   # a new static value: one new plan
    assert len(op._plans) == 2 and len(traces) > n
    with pytest.raises(TypeError, match="hashable"):
        op(x, w, k=[1.0])
    with pytest.raises(TypeError, match="keywords"):
        op(x, 2.0, k=1.0)


def test_jax_function_static_keys_keep_their_types(gen):
    """True == 1 == 1.0 in Python, but a static keyword compiles in its own type: each gets
    its own plan (and fn sees the value it was given), in tuples and dataclasses too."""
    seen = []

    def f(x, w, *, k):
        seen.append(k)
        return jnp.sum(x @ w.T) * 2.0

    op = JaxFunction(f)
    x, w, _, _ = _leaves(gen)
    values = [1, True, 1.0, np.int64(1), (1,), (True,), (("c", 1),), (("c", True),)]
    for k in values:
        op(x, w, k=k).backward()
        with torch.no_grad():
            op(x, w, k=k)
    assert len(op._plans) == len(values) and len(op._primal) == len(values)
    assert [type(k) for k in seen[::2]] == [type(k) for k in values]


def test_jax_function_cache_is_bounded(gen):
    """One compiled program per token count: the cache keeps the ``cache_size`` most recently
    used signatures (it grew with every new N), and an evicted one compiles again, right."""
    traces = []

    def f(x, w):
        traces.append(x.shape[0])
        return jnp.sum(jnp.sin(x @ w.T), axis=1)

    op = JaxFunction(f, cache_size=3)
    w = rand(gen, 5, 4).requires_grad_()
    xs = {n: rand(gen, n, 4).requires_grad_() for n in range(1, 7)}
    for n in (1, 2, 3, 1, 4, 5, 6):  # 1 used again before 4: 4, 5, 6 evict 2, 3, 1
        op(xs[n], w).sum().backward()
        with torch.no_grad():
            op(xs[n], w)
        assert len(op._plans) <= 3 and len(op._primal) <= 3
    assert sorted(sig[0][0][0] for _, _, sig in op._plans.keys()) == [4, 5, 6]
    n_traces = len(traces)
    out = op(xs[2], w)  # evicted: traced again, and still right
    assert len(traces) > n_traces
    want = torch.sin(xs[2] @ w.T).sum(1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="cache_size"):
            JaxFunction(f, cache_size=bad)


def test_jax_function_refuses_forward_mode_ad(gen):
    """A dual input's tangent was dropped silently (the output had tangent None); with
    requires_grad too, autograd's "implement the jvp function". Refused as the loss ops do."""
    import torch.autograd.forward_ad as fwad
    op = JaxFunction(lambda x: jnp.sin(x) * 2, name="sin2")
    x, t = rand(gen, 5), torch.ones(5)
    with fwad.dual_level():
        for primal in (x, x.clone().requires_grad_()):
            with pytest.raises(NotImplementedError, match="sin2 does not support forward-mode"):
                op(fwad.make_dual(primal, t))
    torch.testing.assert_close(op(x), torch.sin(x) * 2)  # plain tensors still run


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_pallas_interpreter_x64_error_speaks_to_pytorch(gen, op):
    """Interpreted Pallas cannot differentiate under jax_enable_x64: the PyTorch caller is
    told what it can do (backend='torch', x64 off, no_grad), not "use backend='xla'"."""
    import logitless.torch as lt
    n, h, v = 5, 4, 7
    x, w = rand(gen, n, h).requires_grad_(), rand(gen, v, h).requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen)
    if op == "linear_cross_entropy":
        run = lambda: lt.linear_cross_entropy(x, w, y, backend="pallas")
    else:
        xt, wt = rand(gen, n, h), rand(gen, v, h)
        run = lambda: lt.linear_jsd(x, w, xt, wt, y, backend="pallas")
    with jax.enable_x64(True):
        with pytest.raises(NotImplementedError, match="jax_enable_x64") as e:
            run().backward()
        assert "backend='torch'" in str(e.value) and "backend='xla'" not in str(e.value)
        with torch.no_grad():
            loss = run()  # the loss alone runs
    assert torch.isfinite(loss)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_pallas_backend_validates_tuning_whatever_ran_before(gen, op, grad):
    """A bad tuning value equal to a good one already compiled (True == 1) is still refused:
    the bridge's compile cache must not hand it the good value's program."""
    import logitless.torch as lt
    n, h, v = 5, 4, 7
    x = rand(gen, n, h).requires_grad_(grad)
    w = rand(gen, v, h).requires_grad_(grad)
    y = torch.randint(0, v, (n,), generator=gen)
    if op == "linear_cross_entropy":
        run = lambda **kw: lt.linear_cross_entropy(x, w, y, backend="pallas", **kw)
    else:
        xt, wt = rand(gen, n, h), rand(gen, v, h)
        run = lambda **kw: lt.linear_jsd(x, w, xt, wt, y, backend="pallas", **kw)
    for good, bad, message in ((dict(chunk_size=1), dict(chunk_size=True), "chunk_size"),
                               (dict(interpret=True), dict(interpret=1), "interpret"),
                               (dict(block_v=16), dict(block_v=16.0), "block_v")):
        with pytest.raises((TypeError, ValueError), match=message):
            run(**bad)   # refused when nothing ran before ...
        run(**good)
        with pytest.raises((TypeError, ValueError), match=message):
            run(**bad)   # ... and after the equal good value compiled


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_pallas_backend_under_torch_compile_is_a_graph_break(gen, op):
    """torch.compile around a model that uses backend="pallas": dynamo cannot trace JAX, so
    the bridge call is a graph break that runs eagerly (it crashed inside dynamo before)."""
    import torch._dynamo as dynamo
    import logitless.torch as lt
    n, h, v = 6, 8, 11
    x, w = rand(gen, n, h), rand(gen, v, h)
    xt, wt = rand(gen, n, h), rand(gen, v, h)
    y = torch.randint(0, v, (n,), generator=gen)
    if op == "linear_cross_entropy":
        f = lambda x, w: lt.linear_cross_entropy(torch.tanh(x), w, y, backend="pallas") * 2
    else:
        f = lambda x, w: lt.linear_jsd(torch.tanh(x), w, xt, wt, y, backend="pallas") * 2
    dynamo.reset()
    got = _leaf_grads(torch.compile(f, backend="eager"), x, w)
    want = _leaf_grads(f, x, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # one graph break: the bridged call, checks included (the torch.func refusal, traced
    # outside the disabled JaxFunction call, was two more, with a Dynamo warning)
    dynamo.reset()
    breaks = _graph_breaks(f, x, w)
    assert len(set(breaks["reasons"])) == 1 and "bridged" in breaks["reasons"][0], breaks
    assert breaks["count"] <= 2 and not breaks["warnings"], breaks


def _graph_breaks(f, *args):
    """torch._dynamo.explain of ``f(*args)``: the break reasons (first line and the skipped
    function), their count, and Dynamo's warnings. Dynamo has no nested graph breaks: one
    break inside the front door is recorded in each frame holding traced ops on the way (the
    caller's and the front door's), hence a count of 2 for a single break."""
    import warnings

    import torch._dynamo as dynamo
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = dynamo.explain(f)(*args)
    return dict(count=e.graph_break_count, reasons=[
        " ".join(str(b.reason).split("Hint")[0].split()) for b in e.break_reasons],
        warnings=[str(m.message) for m in caught if "dynamo" in str(m.message).lower()])


_COMPILE_FIRST_CALL = """
import json, torch
import logitless.torch as lt
import test_bridge as tb
x, w, y = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
if "{op}" == "linear_cross_entropy":
    f = lambda x, w: lt.linear_cross_entropy(torch.tanh(x), w, y, backend="pallas") * 2
else:
    xt, wt = torch.randn(6, 8), torch.randn(11, 8)
    f = lambda x, w: lt.linear_jsd(torch.tanh(x), w, xt, wt, y, backend="pallas") * 2
print(json.dumps(tb._graph_breaks(f, x, w)))
"""


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_pallas_first_call_under_torch_compile_does_not_trace_the_import(op):
    """The first backend="pallas" call imports JAX: outside Dynamo's trace (Dynamo compiled
    frames of JAX's import, warning about its lru_cache, and broke at importlib twice)."""
    r = _fresh_python(_COMPILE_FIRST_CALL.format(op=op),
                      PYTHONPATH=os.path.join(REPO, "tests") + os.pathsep + REPO)
    assert not r["warnings"], r
    assert not any("import_module" in b or "functorch" in b for b in r["reasons"]), r
    assert len(set(r["reasons"])) == 1 and r["count"] <= 2, r


def _leaf_grads(f, *inputs):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = f(*leaves)
    out.backward()
    return [out.detach()] + [t.grad for t in leaves]


def test_jax_function_residual_inputs_are_not_copied(gen):
    """A custom_vjp that saves its inputs: they are re-read from the inputs, not copied."""

    @jax.custom_vjp
    def mm(x, w):
        return x @ w.T

    mm.defvjp(lambda x, w: (x @ w.T, (x, w)), lambda r, g: (g @ r[1], g.T @ r[0]))
    op = JaxFunction(mm)
    x, w, _, _ = _leaves(gen)
    out = op(x, w)
    (plan,) = op._plans.values()
    assert plan.sources == (("in", 0), ("in", 1))
    saved = out.grad_fn.saved_tensors
    assert [s.data_ptr() for s in saved] == [x.data_ptr(), w.data_ptr()]
    gx, gw = torch.autograd.grad(out, (x, w), torch.ones(9, 11))
    np.testing.assert_allclose(as_np(gx), as_np(torch.ones(9, 11) @ w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(as_np(gw), as_np(torch.ones(11, 9) @ x), rtol=1e-5, atol=1e-5)


def test_jax_function_autograd_semantics(gen):
    op = JaxFunction(_jax_ce)
    x, w, b, y = _leaves(gen)
    # retain_graph: the residuals are saved tensors, so a second backward works ...
    loss = op(x, w, y, b, scale=1.0)[0].sum()
    g1 = torch.autograd.grad(loss, x, retain_graph=True)[0]
    g2 = torch.autograd.grad(loss, x)[0]
    assert torch.equal(g1, g2)
    # ... and without it PyTorch frees them, as for any op
    loss = op(x, w, y, b, scale=1.0)[0].sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time|freed"):
        loss.backward()
    # an in-place change to a saved input is caught, as for any op
    x2 = x.detach().clone().requires_grad_()
    xin = x2 * 1.0
    loss = op(xin, w, y, b, scale=1.0)[0].sum()
    xin.mul_(2)
    with pytest.raises(RuntimeError, match="inplace|in-place"):
        loss.backward()
    # grad mode off or nothing requiring grad: forward only, no graph
    with torch.no_grad():
        out = op(x, w, y, b, scale=1.0)
    assert not out[0].requires_grad
    np.testing.assert_allclose(as_np(out[0]), as_np(_torch_ce(x, w, y, b, scale=1.0)[0]),
                               rtol=1e-5, atol=1e-5)
    assert not op(x.detach(), w.detach(), y, b.detach(), scale=1.0)[0].requires_grad
    # only some inputs require grad: the others get None
    gx, = torch.autograd.grad(op(x, w.detach(), y, b.detach(), scale=1.0)[0].sum(), x)
    assert gx.shape == x.shape
    # create_graph=True: an error, also when the incoming gradient does not require grad
    # (it had run, handing back a gradient with no graph: a gradient penalty became 0)
    with pytest.raises(RuntimeError, match=r"_jax_ce \(a JaxFunction\) has no double backward"):
        torch.autograd.grad(op(x, w, y, b, scale=1.0)[0].sum(), x, create_graph=True)


def test_jax_function_gradient_of_reduced_none_output(gen):
    """``.sum()`` hands backward a stride-0 gradient: it is materialized, not mis-read."""
    op = JaxFunction(_jax_ce)
    x, w, b, y = _leaves(gen)
    got = torch.autograd.grad(op(x, w, y, b, scale=1.0)[0].sum(), (x, w, b))
    want = torch.autograd.grad(_torch_ce(x, w, y, b, scale=1.0)[0].sum(), (x, w, b))
    for a, r in zip(got, want):
        np.testing.assert_allclose(as_np(a), as_np(r), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- memory policy
def test_preallocation_policy_unit():
    env = {}
    assert bridge._configure_jax_memory(env, {}, cuda_available=True) == "set"
    assert env == {bridge.PREALLOCATE_VAR: "false"}
    env = {bridge.PREALLOCATE_VAR: "true"}
    assert bridge._configure_jax_memory(env, {}, cuda_available=True) == "user"
    assert env[bridge.PREALLOCATE_VAR] == "true"
    env = {}
    with pytest.warns(RuntimeWarning, match="XLA_PYTHON_CLIENT_PREALLOCATE"):
        assert bridge._configure_jax_memory(env, {"jax": object()}, cuda_available=True) == "warned"
    assert env == {}
    assert bridge._configure_jax_memory(env, {"jax": object()}, cuda_available=False) == "late"


def _fresh_python(code, **env_changes):
    env = {k: v for k, v in os.environ.items() if k != bridge.PREALLOCATE_VAR}
    env.update(env_changes)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bridge_import_sets_preallocate_before_jax():
    r = _fresh_python("import json, os, sys; import logitless.bridge; "
                      "print(json.dumps([os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), "
                      "'jax' in sys.modules]))")
    assert r == ["false", True]


_MEMORY_PROBE = """
import json, torch
free0, total = torch.cuda.mem_get_info()
import logitless.bridge as b
import jax.numpy as jnp
a = b.to_jax(torch.ones(1 << 20, device="cuda"))
(a * 2).block_until_ready()
free1, _ = torch.cuda.mem_get_info()
print(json.dumps({"taken": (free0 - free1) / total}))
"""


@pytest.mark.gpu
@gpu
def test_jax_does_not_preallocate_the_gpu():
    assert _fresh_python(_MEMORY_PROBE)["taken"] < 0.1
    # the probe can fail: with preallocation forced on, JAX takes most of the card
    assert _fresh_python(_MEMORY_PROBE, XLA_PYTHON_CLIENT_PREALLOCATE="true")["taken"] > 0.5


# ------------------------------------------------------------------ streams (GPU only)
RACE_TRIALS = 3


def _busy_torch(a, c, iters):
    """~0.2 s of GPU work on the current stream (fp32 GEMMs without TF32)."""
    for _ in range(iters):
        torch.mm(a, a, out=c)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("sync", [True, False], ids=["synchronized", "handshake-off"])
def test_stream_race_torch_producer_jax_consumer(sync):
    """A tensor finished last on a busy non-default PyTorch stream, read by JAX at once.

    With the handshake JAX waits for it (every trial exact); switched off (tests only) JAX
    reads before the producer wrote it, which the test requires to be observed -- so the
    synchronized variant passing is evidence, not luck.
    """
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(4096, 4096, device=dev) / 64
    c = torch.empty_like(a)
    consume = jax.jit(lambda v: v + 0.0)
    consume(to_jax(torch.zeros(1 << 22, device=dev))).block_until_ready()  # compiled up front
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    wrong = 0
    for trial in range(RACE_TRIALS):
        with torch.cuda.stream(side):
            src = torch.randn(1 << 22, device=dev)
            out = torch.zeros(1 << 22, device=dev)
            _busy_torch(a, c, 100)
            out.copy_(src)                     # the value lands only after the GEMMs
            if sync:
                seen = consume(to_jax(out))
            else:
                with bdl._unsynchronized():
                    seen = consume(to_jax(out))
        seen = np.asarray(seen)
        torch.cuda.synchronize()
        wrong += not np.array_equal(seen, src.cpu().numpy())
    if sync:
        assert wrong == 0
    else:
        assert wrong > 0, "no race observed without the handshake: the test proves nothing"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("sync", [True, False], ids=["synchronized", "handshake-off"])
def test_stream_race_jax_producer_torch_consumer(sync):
    """The reverse: a JAX result finished last in a long jit, read by PyTorch at once."""
    from jax import lax

    @jax.jit
    def produce(a, key):
        b = lax.fori_loop(0, 100, lambda i, b: jnp.tanh(jnp.matmul(a, b, precision="highest")), a)
        return jax.random.normal(key, (1 << 22,)) + 0.0 * b[0, 0]   # written after the loop

    a = jax.random.normal(jax.random.key(0), (4096, 4096)) / 64
    produce(a, jax.random.key(1)).block_until_ready()  # compiled up front
    wrong = 0
    for trial in range(RACE_TRIALS):
        res = produce(a, jax.random.key(SEED + trial))
        if sync:
            seen = to_torch(res).clone()       # on PyTorch's current stream
        else:
            with bdl._unsynchronized():
                seen = to_torch(res).clone()
        seen = seen.cpu().numpy()
        wrong += not np.array_equal(seen, np.asarray(res))
    if sync:
        assert wrong == 0
    else:
        assert wrong > 0, "no race observed without the handshake: the test proves nothing"


# ------------------------------------------------- backend="pallas" from PyTorch (the op)
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_pallas_backend_reads_inputs_in_place(gen, layout, monkeypatch):
    """x, W (either layout: a (V, H) weight or the transpose of an (H, V) one) and the bias
    reach JAX without a copy -- the arrays JAX is handed and the op's saved tensors are the
    caller's memory -- and the result is the one the plain PyTorch backend gives."""
    import logitless.bridge.autograd as ba
    import logitless.torch as lt
    n, h, v = 13, 16, 67
    x = rand(gen, n, h).requires_grad_()
    w_store = rand(gen, v, h) if layout == "vh" else rand(gen, h, v)
    w = (w_store if layout == "vh" else w_store.t()).requires_grad_()
    b = rand(gen, v).requires_grad_()
    y = torch.randint(0, v, (n,), generator=gen).to(torch.int32)
    handed = []  # the buffers of the JAX arrays the bridge passes on
    real = ba._Bridge.forward

    def spy(ctx, call, *tensors):
        handed.extend(a.unsafe_buffer_pointer() for a in call.diff + call.other)
        return real(ctx, call, *tensors)

    monkeypatch.setattr(ba._Bridge, "forward", staticmethod(spy))
    loss, lse = lt.linear_cross_entropy(x, w, y, linear_bias=b, return_lse=True,
                                        backend="pallas")
    mine = {x.data_ptr(), w_store.data_ptr(), b.data_ptr(), y.data_ptr()}
    assert mine <= set(handed), (mine, handed)
    saved = {t.data_ptr() for t in loss.grad_fn.saved_tensors}
    assert mine <= saved
    ref, ref_lse = lt.linear_cross_entropy(x, w, y, linear_bias=b, return_lse=True,
                                           backend="torch")
    g = torch.autograd.grad(loss + lse.sum(), (x, w, b))
    r = torch.autograd.grad(ref + ref_lse.sum(), (x, w, b))
    np.testing.assert_allclose(as_np(loss), as_np(ref), rtol=1e-5)
    for a, e in zip(g, r):
        np.testing.assert_allclose(as_np(a), as_np(e), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("frozen", ["weight", "input"])
@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_pallas_backend_frozen_tensor_costs_no_gradient(gen, op, frozen, reduction):
    """A frozen head (LoRA) or input: the op saves no new tensor of its size for backward
    (the fused forward computes and keeps no float32 dW / no dX for it) and the gradient
    of the other one is the plain PyTorch backend's."""
    import logitless.torch as lt
    n, h, v = 13, 16, 67
    x = rand(gen, n, h).requires_grad_(frozen != "input")
    w = rand(gen, v, h).requires_grad_(frozen != "weight")
    b = rand(gen, v).requires_grad_(frozen != "weight")
    y = torch.randint(0, v, (n,), generator=gen)
    xt, wt = rand(gen, n, h), rand(gen, v, h)
    up = rand(gen, n)

    def run(backend):
        if op == "linear_cross_entropy":
            out = lt.linear_cross_entropy(x, w, y, linear_bias=b, reduction=reduction,
                                          label_smoothing=0.1, backend=backend)
        else:
            out = lt.linear_jsd(x, w, xt, wt, y, reduction=reduction, hard_loss_weight=0.5,
                                backend=backend)
        return out

    # "none": the per-token losses compared as they are (their sum weighted by a random
    # upstream gradient cancels: 1.1e-5 relative apart at seed 1395714771)
    objective = lambda out: out if reduction == "mean" else (out * up).sum()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run("pallas")
    # the inputs themselves may be saved (the unfused path recomputes from them): not new
    inputs = {t.data_ptr() for t in (x, w, b, y, xt, wt)}
    shape = tuple((w if frozen == "weight" else x).shape)  # that of its gradient
    new = [t for t in saved if tuple(t.shape) == shape and t.data_ptr() not in inputs]
    assert not new, f"a {shape} tensor saved for backward: {len(new)}"
    wanted = [t for t in (x, w, b if op == "linear_cross_entropy" else None)
              if t is not None and t.requires_grad]
    got = torch.autograd.grad(objective(out), wanted)
    ref = run("torch")
    want = torch.autograd.grad(objective(ref), wanted)
    np.testing.assert_allclose(as_np(out), as_np(ref), rtol=1e-5)
    for a, e in zip(got, want):
        np.testing.assert_allclose(as_np(a), as_np(e), rtol=1e-4, atol=1e-5)


def test_pallas_backend_refuses_float64(gen):
    import logitless.torch as lt
    x, w = rand(gen, 3, 4).double(), rand(gen, 5, 4).double()
    with pytest.raises(TypeError, match="float64"):
        lt.linear_cross_entropy(x, w, torch.tensor([0, 1, 2]), backend="pallas")


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
@pytest.mark.parametrize("held", [False, True], ids=["not-held", "held-by-a-target"])
def test_pallas_refuses_an_ignore_index_beyond_int32_whatever_the_targets(gen, op, held):
    """The JAX port's targets are int32: an ignore_index beyond it is refused up front with
    the same message whether or not a target holds it (a held one had failed to cross the
    bridge with a message about int64 conversion instead)."""
    import logitless.torch as lt
    x, w = rand(gen, 3, 4), rand(gen, 5, 4)
    y = torch.tensor([0, 2 ** 40 if held else 1, 2])
    call = (lambda: lt.linear_cross_entropy(x, w, y, ignore_index=2 ** 40, backend="pallas")) \
        if op == "linear_cross_entropy" else \
        (lambda: lt.linear_jsd(x, w, x, w, y, ignore_index=2 ** 40, backend="pallas"))
    with pytest.raises(ValueError, match=r"ignore_index must fit in int32 .* got 1099511627776"):
        call()
    # the torch backend takes it
    assert torch.isfinite(getattr(lt, op)(x, w, *((x, w) if op == "linear_jsd" else ()), y,
                                          ignore_index=2 ** 40, backend="torch"))
