"""The PyTorch front door on bad input (every error names the argument), and the input forms
it must accept: the module, ``ignore_index=None``, non-contiguous tensors, leading batch dims.

Runs ``backend="torch"`` on CPU. A second device for the mismatch checks is "meta", which
every torch build has and which the front door rejects before any computation."""
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import logitless.torch as lt
from harness import SEED
from logitless.specs import linear_cross_entropy as spec

N, H, V = 6, 5, 7


def gen(salt):
    return torch.Generator().manual_seed(SEED * 1000 + salt)


def make(salt=0, n=N, h=H, v=V, dtype=torch.float32):
    g = gen(salt)
    x = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype)
    y = torch.randint(0, v, (n,), generator=g)
    return x, w, y


def call(*args, **kw):
    kw.setdefault("backend", "torch")
    return lt.linear_cross_entropy(*args, **kw)


def names(arg):
    """A regex for ``arg`` as a whole word ("weight" must not match inside "linear_weight")."""
    return rf"(?<![\w]){re.escape(arg)}(?![\w])"


# ----------------------------------------------------------------------------- bad input
def _bad_calls():
    x, w, y = make()
    b, cw = torch.randn(V), torch.rand(V) + 0.5
    f64, bf16 = torch.float64, torch.bfloat16
    return [
        # (id, args, kwargs, exception, the argument the message must name)
        ("input-0d", (torch.tensor(1.0), w, y), {}, ValueError, "input"),
        ("weight-1d", (x, w[0], y), {}, ValueError, "linear_weight"),
        ("weight-3d", (x, w[None], y), {}, ValueError, "linear_weight"),
        ("weight-empty-V", (x, w[:0], y), {}, ValueError, "linear_weight"),
        ("hidden-mismatch", (x, w[:, :-1], y), {}, ValueError, "linear_weight"),
        ("hidden-mismatch-transposed", (x, w.t(), y), {}, ValueError, "linear_weight"),
        ("target-short", (x, w, y[:-1]), {}, ValueError, "target"),
        ("target-2d", (x, w, y[None]), {}, ValueError, "target"),
        ("target-batched-vs-flat", (x.reshape(2, 3, H), w, y), {}, ValueError, "target"),
        ("target-0d", (x, w, y[0]), {}, ValueError, "target"),
        ("bias-len", (x, w, y), dict(linear_bias=torch.randn(V + 1)), ValueError, "linear_bias"),
        ("bias-2d", (x, w, y), dict(linear_bias=b[None]), ValueError, "linear_bias"),
        ("classweight-len", (x, w, y), dict(weight=cw[:-1]), ValueError, "weight"),
        ("classweight-2d", (x, w, y), dict(weight=cw[:, None]), ValueError, "weight"),
        ("input-int", (x.long(), w.long(), y), {}, TypeError, "input"),
        ("input-bool", (x > 0, w, y), {}, TypeError, "input"),
        ("weight-dtype", (x, w.to(f64), y), {}, TypeError, "linear_weight"),
        ("weight-dtype-bf16", (x, w.to(bf16), y), {}, TypeError, "linear_weight"),
        ("bias-dtype", (x, w, y), dict(linear_bias=b.to(f64)), TypeError, "linear_bias"),
        ("classweight-int", (x, w, y), dict(weight=torch.ones(V, dtype=torch.long)),
         TypeError, "weight"),
        ("target-float", (x, w, y.float()), {}, TypeError, "target"),
        ("target-double", (x, w, y.double()), {}, TypeError, "target"),
        ("target-bool", (x, w, y > 2), {}, TypeError, "target"),
        ("target-probs", (x, w, torch.softmax(torch.randn(N, V), 1)), {}, TypeError, "target"),
        ("input-numpy", (x.numpy(), w, y), {}, TypeError, "input"),
        ("input-list", (x.tolist(), w, y), {}, TypeError, "input"),
        ("weight-numpy", (x, w.numpy(), y), {}, TypeError, "linear_weight"),
        ("target-list", (x, w, y.tolist()), {}, TypeError, "target"),
        ("target-int", (x[0], w, 3), {}, TypeError, "target"),
        ("bias-numpy", (x, w, y), dict(linear_bias=b.numpy()), TypeError, "linear_bias"),
        ("classweight-list", (x, w, y), dict(weight=cw.tolist()), TypeError, "weight"),
        ("weight-meta", (x, w.to("meta"), y), {}, ValueError, "linear_weight"),
        ("target-meta", (x, w, y.to("meta")), {}, ValueError, "target"),
        ("bias-meta", (x, w, y), dict(linear_bias=b.to("meta")), ValueError, "linear_bias"),
        ("classweight-meta", (x, w, y), dict(weight=cw.to("meta")), ValueError, "weight"),
        ("input-meta", (x.to("meta"), w, y), {}, ValueError, "input"),
        ("reduction", (x, w, y), dict(reduction="avg"), ValueError, "reduction"),
        ("reduction-none-object", (x, w, y), dict(reduction=None), ValueError, "reduction"),
        ("smoothing-high", (x, w, y), dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        ("smoothing-neg", (x, w, y), dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        ("smoothing-nan", (x, w, y), dict(label_smoothing=float("nan")), TypeError,
         "label_smoothing"),
        ("smoothing-tensor", (x, w, y), dict(label_smoothing=torch.tensor(0.1)), TypeError,
         "float(t) of a 0-d tensor"),
        ("zloss-neg", (x, w, y), dict(z_loss=-1e-4), ValueError, "z_loss"),
        ("zloss-inf", (x, w, y), dict(z_loss=float("inf")), TypeError, "z_loss"),
        ("softcap-zero", (x, w, y), dict(softcap=0.0), ValueError, "softcap"),
        ("softcap-neg", (x, w, y), dict(softcap=-30.0), ValueError, "softcap"),
        ("softcap-inf", (x, w, y), dict(softcap=float("inf")), TypeError, "softcap"),
        ("ignore-float", (x, w, y), dict(ignore_index=-100.0), TypeError, "ignore_index"),
        ("ignore-str", (x, w, y), dict(ignore_index="-100"), TypeError, "ignore_index"),
        ("ignore-tensor", (x, w, y), dict(ignore_index=torch.tensor(-100)), TypeError,
         "int(t) of a 0-d tensor"),
        ("return_lse", (x, w, y), dict(return_lse=1), TypeError, "return_lse"),
        ("backend", (x, w, y), dict(backend="cuda"), ValueError, "backend"),
        ("backend-case", (x, w, y), dict(backend="Torch"), ValueError, "backend"),
        ("tuning-unknown", (x, w, y), dict(block_size=64), TypeError, "block_size"),
        ("tuning-typo", (x, w, y), dict(chunksize=64), TypeError, "chunksize"),
        ("chunk_size-zero", (x, w, y), dict(chunk_size=0), ValueError, "chunk_size"),
        ("chunk_size-float", (x, w, y), dict(chunk_size=2.5), ValueError, "chunk_size"),
        ("memory_budget-zero", (x, w, y), dict(memory_budget=0), ValueError, "memory_budget"),
        ("memory_budget-neg", (x, w, y), dict(memory_budget=-1), ValueError, "memory_budget"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("args, kwargs, exc, arg", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(args, kwargs, exc, arg):
    with pytest.raises(exc, match=names(arg)):
        call(*args, **kwargs)


def test_hidden_size_mismatch_names_both_and_the_sizes():
    x, w, _ = make()
    with pytest.raises(ValueError) as e:
        call(x, w[:, :-1], torch.zeros(N, dtype=torch.long))
    msg = str(e.value)
    assert re.search(names("input"), msg) and "linear_weight" in msg
    assert f"H={H}" in msg and str((V, H - 1)) in msg


def test_dtype_mismatch_names_both_dtypes():
    x, w, y = make()
    with pytest.raises(TypeError) as e:
        call(x, w.double(), y)
    assert "torch.float64" in str(e.value) and "torch.float32" in str(e.value)


def test_device_mismatch_names_both_devices():
    x, w, y = make()
    with pytest.raises(ValueError) as e:
        call(x, w, y.to("meta"))
    assert "meta" in str(e.value) and "cpu" in str(e.value)


def test_module_rejects_bad_options_at_construction():
    with pytest.raises(ValueError, match=names("reduction")):
        lt.LinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match=names("label_smoothing")):
        lt.LinearCrossEntropyLoss(label_smoothing=2.0)
    with pytest.raises(ValueError, match=names("softcap")):
        lt.LinearCrossEntropyLoss(softcap=0.0)


# ----------------------------------------------------------------------------- targets
@pytest.mark.parametrize("bad, ignore_index", [
    (V, -100), (V + 1000, -100), (-1, -100), (-100, -1), (-101, -100), (V, V + 1), (2**40, -100),
])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_target_out_of_range(bad, ignore_index, reduction):
    """On CPU the no-sync device assert raises at once, with the spec's message."""
    x, w, y = make(1)
    y[N // 2] = bad
    msg = spec.target_range_message(V, ignore_index)
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        call(x, w, y, ignore_index=ignore_index, reduction=reduction)
    assert "target" in msg and f"[0, {V})" in msg and f"ignore_index={ignore_index}" in msg


@pytest.mark.parametrize("ignore_index", [-100, -1, 0, 3, V - 1, V, 10**6])
def test_target_equal_to_ignore_index_is_fine(ignore_index):
    """Ignored tokens, whatever the ignore_index (inside [0, V) included), match torch's CE."""
    x, w, y = make(2, dtype=torch.float64)
    y[::2] = ignore_index
    y[1] = (ignore_index + 1) % V   # one kept token, whatever ignore_index is
    for red in ("mean", "sum", "none"):
        got = call(x, w, y, ignore_index=ignore_index, reduction=red)
        want = F.cross_entropy(x @ w.T, y, ignore_index=ignore_index, reduction=red)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_integer_target_dtypes(dtype):
    """Any integer dtype, uint8 past 127 included: compared in uint8, ignore_index=-100 would
    wrap to 156 and ignore that class."""
    x, w, y = make(3, v=160, dtype=torch.float64)
    y[::2], y[1] = 156, 130
    want = F.cross_entropy(x @ w.T, y, reduction="none")
    torch.testing.assert_close(call(x, w, y.to(dtype), reduction="none"), want, rtol=1e-12,
                               atol=1e-12)


def test_int32_targets_with_an_ignore_index_beyond_int32():
    """Compared in int32, ignore_index=2**40 would wrap to 0 and ignore class 0."""
    x, w, y = make(10, dtype=torch.float64)
    big = 2**40
    y[::2] = 0
    want = F.cross_entropy(x @ w.T, y, ignore_index=big)
    torch.testing.assert_close(call(x, w, y.int(), ignore_index=big), want, rtol=1e-12,
                               atol=1e-12)
    x2, w2, y2 = make(11)
    y2[::2] = 0
    xt = torch.randn(N, 3, generator=gen(12))
    wt = torch.randn(V, 3, generator=gen(13))
    torch.testing.assert_close(
        lt.linear_jsd(x2, w2, xt, wt, y2.int(), ignore_index=big, backend="torch"),
        lt.linear_jsd(x2, w2, xt, wt, y2, ignore_index=big, backend="torch"), rtol=0, atol=0)


# ----------------------------------------------------------------------------- accepted forms
def _grads(loss_fn, *leaves):
    out = loss_fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = gen(99)
    cot = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, [t for t in leaves if t.requires_grad], cot)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_matches_function(reduction):
    x, w, y = make(4, n=37, h=9, v=31)
    y[::5] = -1
    g = gen(5)
    b = torch.randn(31, generator=g).requires_grad_()
    cw = torch.rand(31, generator=g) + 0.5
    opts = dict(weight=cw, reduction=reduction, ignore_index=-1, label_smoothing=0.1,
                z_loss=1e-3, softcap=3.0, return_lse=True, backend="torch", chunk_size=8)
    mod = lt.LinearCrossEntropyLoss(**opts)
    x.requires_grad_(), w.requires_grad_()
    a_out, a_grads = _grads(lambda x, w, b: mod(x, w, y, b), x, w, b)
    f_out, f_grads = _grads(lambda x, w, b: lt.linear_cross_entropy(x, w, y, linear_bias=b, **opts),
                            x, w, b)
    for a, f in zip(a_out + a_grads, f_out + f_grads):
        torch.testing.assert_close(a, f, rtol=0, atol=0)
    assert torch.isfinite(a_out[0]).all() and a_out[1].shape == (37,)


def test_ignore_index_none_means_minus_100():
    x, w, y = make(6, dtype=torch.float64)
    y[1::2] = -100
    want = F.cross_entropy(x @ w.T, y)
    for red in ("mean", "none"):
        torch.testing.assert_close(call(x, w, y, ignore_index=None, reduction=red),
                                   call(x, w, y, ignore_index=-100, reduction=red),
                                   rtol=0, atol=0)
    torch.testing.assert_close(call(x, w, y, ignore_index=None), want, rtol=1e-12, atol=1e-12)
    mod = lt.LinearCrossEntropyLoss(ignore_index=None, backend="torch")
    torch.testing.assert_close(mod(x, w, y), want, rtol=1e-12, atol=1e-12)
    y[0] = -1   # -1 is not ignored when ignore_index is None
    with pytest.raises(RuntimeError, match=re.escape(spec.target_range_message(V, -100))):
        call(x, w, y, ignore_index=None)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_non_contiguous_inputs(reduction):
    """A sliced hidden state and a transposed (H, V) weight give the loss and grads of their
    contiguous copies; the gradient reaches the wider tensors they are views of."""
    n, h, v = 37, 9, 31
    g = gen(7)
    wide = torch.randn(n, 2 * h, generator=g).requires_grad_()
    emb = (torch.randn(h, v, generator=g) / h ** 0.5).requires_grad_()   # (H, V)
    y = torch.randint(0, v, (n,), generator=g)
    y[::4] = -100
    b = torch.randn(v, generator=g).requires_grad_()
    x, w = wide[:, ::2], emb.t()
    assert not x.is_contiguous() and not w.is_contiguous()
    kw = dict(linear_bias=b, reduction=reduction, label_smoothing=0.1, softcap=4.0,
              return_lse=True, chunk_size=8)
    xc = x.detach().clone().requires_grad_()
    wc = w.detach().contiguous().requires_grad_()
    (loss, lse), (d_wide, d_emb, db) = _grads(lambda a, e, b: call(a[:, ::2], e.t(), y, **kw),
                                              wide, emb, b)
    (loss_c, lse_c), (dxc, dwc, dbc) = _grads(lambda a, e, b: call(a, e, y, **kw), xc, wc, b)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    close(loss, loss_c), close(lse, lse_c), close(db, dbc)
    close(d_wide[:, ::2], dxc)
    assert torch.all(d_wide[:, 1::2] == 0)
    close(d_emb, dwc.t())
    assert d_emb.abs().max() > 0 and dxc.abs().max() > 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_leading_batch_dims(reduction):
    b_, t_, h, v = 3, 5, 7, 13
    g = gen(8)
    x = torch.randn(b_, t_, h, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(v, h, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randint(0, v, (b_, t_), generator=g)
    y[0, ::2] = -100
    loss, lse = call(x, w, y, reduction=reduction, return_lse=True, z_loss=1e-2)
    shape = (b_, t_) if reduction == "none" else ()
    assert loss.shape == shape and lse.shape == (b_, t_)
    flat, flat_lse = call(x.reshape(-1, h), w, y.reshape(-1), reduction=reduction,
                          return_lse=True, z_loss=1e-2)
    torch.testing.assert_close(loss, flat.reshape(shape), rtol=0, atol=0)
    torch.testing.assert_close(lse, flat_lse.reshape(b_, t_), rtol=0, atol=0)
    ce = F.cross_entropy(x.reshape(-1, h) @ w.T, y.reshape(-1), reduction="none").reshape(b_, t_)
    want_lse = torch.logsumexp(x @ w.T, -1)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    if reduction == "none":
        want = ce + 1e-2 * (y != -100).double() * want_lse ** 2
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    dx, = torch.autograd.grad(loss.sum(), x)
    assert dx.shape == x.shape and torch.all(dx[0, ::2] == 0) and dx[0, 1].abs().max() > 0


def test_unbatched_single_token():
    """input (H,) with a 0-d target, as F.cross_entropy allows."""
    x, w, y = make(9, dtype=torch.float64)
    for red in ("mean", "sum", "none"):
        got = call(x[0], w, y[0], reduction=red)
        assert got.shape == ()
        torch.testing.assert_close(got, F.cross_entropy(x[0] @ w.T, y[0]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(reduction):
    """No tokens at all is the all-ignored rule: loss 0 (not NaN), zero grads."""
    x = torch.randn(0, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.zeros(0, dtype=torch.long)
    loss = call(x, w, y, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert torch.all(loss == 0)
    loss.sum().backward()
    assert w.grad is not None and torch.all(w.grad == 0) and x.grad.shape == (0, H)


# ----------------------------------------------------------------------------- keywords
def _jsd_args(salt=20):
    g = gen(salt)
    return (torch.randn(N, H, generator=g), torch.randn(V, H, generator=g),
            torch.randn(N, 3, generator=g), torch.randn(V, 3, generator=g))


@pytest.mark.parametrize("op, kw, hint", [
    ("ce", dict(label_smothing=0.1), "did you mean 'label_smoothing'?"),
    ("both", dict(ignore_indx=-1), "did you mean 'ignore_index'?"),
    ("both", dict(chunksize=4), "did you mean 'chunk_size'?"),
    ("ce", dict(targets=None), "did you mean 'target'?"),
    ("jsd", dict(temprature=2.0), "did you mean 'temperature'?"),
    ("both", dict(weight_layout="hv"), "weight_layout is a logitless.jax keyword"),
    ("ce", dict(axis_name="tp"), "axis_name is a logitless.jax keyword; PyTorch's vocabulary "
                                 "parallelism takes process_group="),
    ("jsd", dict(process_group=None), "linear_jsd has no vocab-parallel path (process_group= is "
                                      "a keyword of linear_cross_entropy): give it the whole "
                                      "student and teacher heads)"),
    ("jsd", dict(vocab_size=8), "linear_jsd has no vocab-parallel path (vocab_size= is a "
                                "keyword of linear_cross_entropy)"),
    # PyTorch's linear_cross_entropy has no axis_name= either: logitless.jax's has
    ("jsd", dict(axis_name="tp"), "linear_jsd has no vocab-parallel path (axis_name= is a "
                                  "keyword of logitless.jax's linear_cross_entropy): give it "
                                  "the whole student and teacher heads)"),
])
def test_misspelled_or_foreign_keywords_come_first_with_a_hint(op, kw, hint):
    """Checked before the shapes (a bad shape here must not hide the keyword), worded as
    Python's own TypeError, with the closest name or what replaces a JAX keyword; the
    modules check at construction."""
    x, w, y = make()
    k = next(iter(kw))
    calls = []
    if op in ("ce", "both"):
        calls += [("linear_cross_entropy", lambda: lt.linear_cross_entropy(x, w.t(), y, **kw)),
                  ("LinearCrossEntropyLoss", lambda: lt.LinearCrossEntropyLoss(**kw))]
    if op in ("jsd", "both"):
        args = _jsd_args()[:3] + (w.t(),)
        calls += [("linear_jsd", lambda: lt.linear_jsd(*args, **kw)),
                  ("LinearJSDLoss", lambda: lt.LinearJSDLoss(**kw))]
    for name, fn in calls:
        with pytest.raises(TypeError, match=re.escape(
                f"{name}() got an unexpected keyword argument {k!r} ({hint}")):
            fn()


def test_modules_name_their_own_parameters():
    """A module's constructor suggests among its own keywords (the function's options= too),
    and says where a forward() argument goes instead of suggesting that very name."""
    assert lt.LinearCrossEntropyLoss(options=None).compat_options is None
    for make_mod, arg in ((lt.LinearCrossEntropyLoss, "linear_bias"),
                          (lt.LinearCrossEntropyLoss, "target"), (lt.LinearJSDLoss, "target"),
                          (lt.LinearJSDLoss, "teacher_weight")):
        with pytest.raises(TypeError, match=re.escape(
                f"got an unexpected keyword argument {arg!r} ({arg} is an argument of "
                f"forward(), not of the constructor)")):
            make_mod(**{arg: None})
    with pytest.raises(TypeError, match=re.escape("'reducton' (did you mean 'reduction'?)")):
        lt.LinearJSDLoss(reducton="sum")
    # a near miss of a forward() argument: the suggestion says where it goes
    with pytest.raises(TypeError, match=re.escape(
            "'targets' (did you mean 'target'? target is an argument of forward(), not of the "
            "constructor)")):
        lt.LinearCrossEntropyLoss(targets=None)

    # a subclass with its own constructor: suggestions still come from the loss's keywords
    class MyLoss(lt.LinearCrossEntropyLoss):
        def __init__(self, scale=1.0, **kwargs):
            super().__init__(**kwargs)

    class MyJSD(lt.LinearJSDLoss):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
    for make_mod, typo, meant in ((MyLoss, "reducton", "reduction"),
                                  (MyJSD, "tempreature", "temperature")):
        with pytest.raises(TypeError, match=re.escape(f"(did you mean {meant!r}?)")):
            make_mod(**{typo: 1})


def test_modules_check_tuning_keywords_at_construction():
    with pytest.raises(TypeError, match=r"\['low_memory'\] for backend='torch'"):
        lt.LinearCrossEntropyLoss(backend="torch", low_memory=True)
    with pytest.raises(TypeError, match=r"\['fp32_logits'\] for backend='torch'"):
        lt.LinearJSDLoss(backend="torch", fp32_logits=False)
    with pytest.raises(TypeError, match=r"\['low_memory'\] with process_group"):
        lt.LinearCrossEntropyLoss(process_group=object(), low_memory=True)
    lt.LinearCrossEntropyLoss(low_memory=True, chunk_size=4)  # backend=None: either's keywords
    lt.LinearJSDLoss(fp32_logits=False, chunk_size=4)
    mod = lt.LinearCrossEntropyLoss(backend="triton", low_memory=True)
    assert mod.tuning == {"low_memory": True}


def test_another_backends_keyword_warns_once_and_is_dropped_with_backend_none(monkeypatch):
    """A GPU script's Triton keyword, smoke-tested on CPU (backend=None picks "torch"):
    a warning naming the keyword and the backend picked, once; a named backend raises."""
    from logitless import _torch_common as common
    monkeypatch.setattr(common, "_WARNED", set())
    x, w, y = make(14)
    want = call(x, w, y, chunk_size=2)
    with pytest.warns(UserWarning, match=r"backend='torch'.*'low_memory'"):
        got = lt.linear_cross_entropy(x, w, y, low_memory=True, chunk_size=2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    mod = lt.LinearCrossEntropyLoss(low_memory=True, chunk_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        torch.testing.assert_close(mod(x, w, y), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"\['low_memory'\] for backend='torch'"):
        call(x, w, y, low_memory=True)
    args = _jsd_args()
    with pytest.warns(UserWarning, match=r"linear_jsd.*backend='torch'.*'row_sync'"):
        got = lt.linear_jsd(*args, row_sync=True)
    torch.testing.assert_close(got, lt.linear_jsd(*args), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"\['row_sync'\] for backend='torch'"):
        lt.linear_jsd(*args, row_sync=True, backend="torch")


def test_triton_keyword_names_known_without_triton_match_the_backends():
    """The front doors' copies of the Triton backends' keywords (used where Triton is not
    installed) equal the modules' own."""
    from logitless import _torch_jsd
    from logitless import torch as front
    from logitless.triton_kernels import linear_cross_entropy as tce, linear_jsd as tjsd
    assert front._TRITON_TUNING == tce.TUNING
    assert _torch_jsd._TRITON_TUNING == tjsd.TUNING


def test_docstrings_list_every_tuning_keyword():
    import pydoc
    from logitless import torch_chunked, torch_jsd
    from logitless.triton_kernels import linear_cross_entropy as tce, linear_jsd as tjsd
    for fn, mods in ((lt.linear_cross_entropy, (torch_chunked, tce)),
                     (lt.linear_jsd, (torch_jsd, tjsd))):
        text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
        for mod in mods:
            backend_doc = getattr(mod, fn.__name__).__doc__
            for k in mod.TUNING:
                assert f"``{k}`` (" in text, (fn.__name__, k)  # with its default
                assert f"``{k}`` (" in backend_doc, (mod.__name__, k)
    assert "896 MiB" in tce.linear_cross_entropy.__doc__
    assert "use_reentrant=True" in lt.linear_cross_entropy.__doc__


# ----------------------------------------------------------------------------- shape hints
@pytest.mark.parametrize("args, hint", [
    (lambda x, w, y: (x, w.t(), y), "linear_weight looks like (H, V): pass linear_weight.T"),
    (lambda x, w, y: (x @ w.t(), w, y), "input's last dimension is V: pass hidden states, not logits"),
    (lambda x, w, y: (w, x, y), "arguments are (input, linear_weight, target): was the weight passed first?"),
    (lambda x, w, y: (w, x.reshape(2, 10, H), y.reshape(2, 10)),
     "arguments are (input, linear_weight, target): was the weight passed first?"),
])
def test_shape_errors_hint_at_the_usual_mix_up(args, hint):
    x, w, y = make(15, n=20, v=40)  # V > H, as vocabularies are
    with pytest.raises(ValueError, match=re.escape(hint)):
        call(*args(x, w, y))


def test_jsd_and_hv_layout_shape_hints():
    xs, ws, xt, wt = _jsd_args()
    ws, wt = torch.randn(40, H), torch.randn(40, 3)
    with pytest.raises(ValueError, match=re.escape(
            "student_weight looks like (H, V): pass student_weight.T")):
        lt.linear_jsd(xs, ws.t(), xt, wt)
    with pytest.raises(ValueError, match=re.escape(
            "teacher_input's last dimension is V: pass hidden states, not logits")):
        lt.linear_jsd(xs, ws, xt @ wt.t(), wt)
    with pytest.raises(ValueError, match=re.escape(
            "linear_weight looks like (V, H): use weight_layout='vh'")):
        spec.check_shapes((6, 5), (40, 5), (6,), weight_layout="hv")
    with pytest.raises(ValueError, match=re.escape("looks like (H, V): pass weight_layout='hv'")):
        spec.check_shapes((6, 5), (5, 40), (6,), transpose_hint="pass weight_layout='hv'")


def test_rocm_gpus_are_not_handed_to_the_triton_kernels(monkeypatch):
    # ROCm builds call their GPUs "cuda"; the kernels are for NVIDIA's 32-lane warps
    from logitless import _torch_common as common
    from logitless import _torch_jsd
    lt._load("triton"), _torch_jsd._load("triton")  # imported, as after a first call
    assert common.triton_gpu(torch.device("cuda")) and not common.triton_gpu(torch.device("cpu"))
    assert "triton" in lt.available_backends("cuda")
    assert "triton" in _torch_jsd.available_backends("cuda")
    assert lt._resolve(None, torch.device("cuda"), torch.bfloat16)[0] == "triton"
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert not common.triton_gpu(torch.device("cuda"))
    assert "triton" not in lt.available_backends("cuda")
    assert "triton" not in _torch_jsd.available_backends("cuda")
    assert lt._resolve(None, torch.device("cuda"), torch.bfloat16)[0] == "torch"
    assert _torch_jsd._resolve(None, torch.device("cuda"), torch.bfloat16)[0] == "torch"


def test_modules_check_the_backend_at_construction_and_pallas_needs_jax(monkeypatch):
    """A misspelled backend fails when the module is built, not at its first forward; and
    "pallas" is listed only where JAX can be imported (it was listed regardless)."""
    import importlib.util
    from logitless import _torch_jsd
    for cls in (lt.LinearCrossEntropyLoss, lt.LinearJSDLoss):
        with pytest.raises(ValueError, match="backend must be None or one of"):
            cls(backend="trition")
    assert "pallas" in lt.available_backends() and "pallas" in _torch_jsd.available_backends()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else find_spec(name, *a))
    assert lt.available_backends() == ["torch"] == _torch_jsd.available_backends()
