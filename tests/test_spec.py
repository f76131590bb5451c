"""The linear cross-entropy spec against float64 autodiff, and the spec's own validation.

``spec.reference`` computes its gradients from the closed-form formulas of the module
docstring. Here two independent oracles differentiate a materialized-logits formulation
automatically, in float64:

* torch: ``F.cross_entropy`` itself (``weight``, ``label_smoothing``, ``ignore_index``, each
  reduction) plus the z-loss term, ``torch.autograd.grad``;
* JAX: a target-distribution formulation (``-Σ_v q_iv·log_softmax(c)_iv``), ``jax.vjp``, with
  x64 enabled only inside a context manager so no other test sees the flag.

Loss, per-token loss, lse, dlogits, dx, dW and db must agree to 1e-10 of the output's scale
(plus 1e-12 absolute: see ATOL).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Optional

import numpy as np
import pytest

from harness import SEED
from helpers import assert_close_abs
from logitless.specs import linear_cross_entropy as spec

RTOL = 1e-10
# Inputs are O(1) by construction (draw), so every output's natural scale is >= ~1 and 1e-12 is
# thousands of float64 ulps of it. ATOL only matters where an output is tiny by cancellation:
# a saturated softmax makes dlogits = p_y - 1 ~ 1e-7, exact to ~1e-16 absolute in both the
# spec and autodiff, which is beyond 1e-10 *relative* to that tiny value.
ATOL = 1e-12


@dataclasses.dataclass(frozen=True)
class SpecCase:
    n: int = 37
    h: int = 33
    v: int = 97                    # N, H odd; V prime; none a multiple of 8
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: Optional[float] = None
    bias: bool = False
    class_weight: bool = False
    weight_scale: float = 1.0      # class weights times this (Σω in (0, 1), or negative)
    ignore: str = "some"           # "none" | "some" | "all"
    ignore_index: int = -100
    lse_grad: bool = False         # an upstream gradient on lse as well as on the loss

    @property
    def id(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        default = SpecCase()
        parts = [f"{self.n}x{self.h}x{self.v}", self.reduction]
        parts += [f"{k}={val}" for k, val in d.items()
                  if k not in ("n", "h", "v", "reduction") and val != getattr(default, k)]
        return "-".join(parts)

    def options(self) -> spec.LinearCrossEntropyOptions:
        return spec.LinearCrossEntropyOptions(
            reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
            return_lse=self.lse_grad)


def draw(case: SpecCase):
    """Fresh float64 inputs; the seed is the session's (harness.SEED) and the case's id."""
    rng = np.random.default_rng([SEED, zlib.crc32(case.id.encode())])
    n, h, v, ii = case.n, case.h, case.v, case.ignore_index
    x = rng.standard_normal((n, h))
    W = rng.standard_normal((v, h)) * (3.0 / math.sqrt(h))  # logits of std ~3
    y = rng.integers(0, v, n)
    if case.ignore == "none":
        # an ignore_index inside [0, V) must not be hit by chance
        while (y == ii).any():
            y = np.where(y == ii, rng.integers(0, v, n), y)
    elif case.ignore == "some":
        y[rng.random(n) < 0.25] = ii
        y[0] = ii                                   # at least one ignored ...
        if n > 1:
            y[1] = (ii + 1) % v if 0 <= ii < v else rng.integers(0, v)  # ... and one kept
    else:
        y[:] = ii
    bias = rng.standard_normal(v) * 0.5 if case.bias else None
    cw = rng.uniform(0.25, 2.0, v) * case.weight_scale if case.class_weight else None
    if case.reduction == "none":
        g = rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)  # per-token, either sign
    else:
        g = np.asarray(rng.uniform(0.5, 2.0))
    gl = rng.standard_normal(n) if case.lse_grad else np.zeros(n)
    return dict(x=x, W=W, y=y, bias=bias, cw=cw, g=g, gl=gl)


def run_spec(case, d):
    r = spec.reference(d["x"], d["W"], d["y"], bias=d["bias"], weight=d["cw"],
                       options=case.options(), grad_output=d["g"],
                       grad_lse=d["gl"] if case.lse_grad else None)
    return dict(loss=r["loss"], token_loss=r["token_loss"], lse=r["lse"],
                dz=r["grad_logits"], dx=r["dx"], dw=r["dw"], db=r["db"])


# ----------------------------------------------------------------------------- torch oracle
@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The torch oracle runs hundreds of tiny float64 ops: on a 2-core CI box, intra-op
    threads only add spin-waiting (10x the CPU time here). Restored afterwards."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def torch_oracle(case, d):
    import torch
    import torch.nn.functional as F

    t = lambda a: None if a is None else torch.tensor(a, dtype=torch.float64)
    x, W = t(d["x"]).requires_grad_(), t(d["W"]).requires_grad_()
    b = t(d["bias"] if case.bias else np.zeros(case.v)).requires_grad_()
    y, cw = torch.tensor(d["y"]), t(d["cw"])
    z = x @ W.T + b
    z.retain_grad()
    s = case.softcap
    c = z if s is None else s * torch.tanh(z / s)
    ce = lambda red: F.cross_entropy(c, y, weight=cw, ignore_index=case.ignore_index,
                                     label_smoothing=case.label_smoothing, reduction=red)
    lse = torch.logsumexp(c, dim=1)
    keep = y != case.ignore_index
    omega = keep.double() if cw is None else torch.where(keep, cw[torch.where(keep, y, 0)], 0.0)
    zl = case.z_loss * omega * lse ** 2
    token_loss = ce("none") + zl
    if case.reduction == "none":
        loss = ce("none") + zl
    elif case.reduction == "sum":
        loss = ce("sum") + zl.sum()
    elif omega.sum() != 0:  # a negative Σω divides too (F.cross_entropy's "mean")
        loss = ce("mean") + zl.sum() / omega.sum()
    else:
        # torch's mean of an all-ignored batch is 0/0 = NaN; the spec defines it as 0 (the
        # sum over no tokens, divided by 1). test_all_ignored_* checks the NaN claim.
        loss = ce("sum") + zl.sum()
    dx, dw, db, dz = torch.autograd.grad(
        [loss, lse], [x, W, b, z], [t(d["g"]), t(d["gl"])], retain_graph=True)
    f = lambda a: a.detach().numpy()
    return dict(loss=f(loss), token_loss=f(token_loss), lse=f(lse), dz=f(dz),
                dx=f(dx), dw=f(dw), db=f(db))


# ----------------------------------------------------------------------------- JAX oracle
def _x64():
    import jax
    if hasattr(jax, "enable_x64"):        # jax >= 0.9: a config context manager
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # older jax
    return enable_x64()


@functools.lru_cache(maxsize=None)
def _jax_oracle_fn():
    """The JAX oracle, jitted once. Option values (softcap on/off included) are traced and
    every reduction is differentiated in the one program, so each input shape compiles once
    (eager JAX would compile every op per shape, jit per option set: both cost seconds)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(x, W, b, y, cw, g_scalar, g_tok, gl, eps, zeta, capped, s, ii):
        v = W.shape[0]
        keep = (y != ii).astype(x.dtype)
        # smoothed, class-weighted target distribution: the loss is -Σ_v q_v·log p_v
        onehot = jax.nn.one_hot(jnp.where(y != ii, y, 0), v, dtype=x.dtype) * keep[:, None]
        q = (1 - eps) * onehot * cw + keep[:, None] * (eps / v) * cw
        omega = onehot @ cw

        def f(reduction, x, W, b, delta):  # z + delta with delta = 0: its cotangent is dlogits
            z = x @ W.T + b + delta
            c = jnp.where(capped, s * jnp.tanh(z / s), z)
            lse = jax.nn.logsumexp(c, axis=1)
            tok = -jnp.sum(q * jax.nn.log_softmax(c, axis=1), axis=1) + zeta * omega * lse ** 2
            if reduction == "none":
                loss = tok
            else:
                loss = jnp.sum(tok)
                if reduction == "mean":
                    loss = loss / jnp.where(omega.sum() != 0, omega.sum(), 1.0)
            return (loss, lse), tok

        out = {}
        for red in REDUCTIONS:
            (loss, lse), vjp, tok = jax.vjp(
                functools.partial(f, red), x, W, b, jnp.zeros((x.shape[0], v), x.dtype),
                has_aux=True)
            dx, dw, db, dz = vjp((g_tok if red == "none" else g_scalar, gl))
            out[red] = dict(loss=loss, token_loss=tok, lse=lse, dz=dz, dx=dx, dw=dw, db=db)
        return out

    return run


def jax_oracle(case, d):
    with _x64():
        f64 = lambda a: np.asarray(a, np.float64)
        none = case.reduction == "none"
        out = _jax_oracle_fn()(
            f64(d["x"]), f64(d["W"]), f64(d["bias"] if case.bias else np.zeros(case.v)),
            np.asarray(d["y"], np.int64), f64(np.ones(case.v) if d["cw"] is None else d["cw"]),
            f64(1.0 if none else d["g"]), f64(d["g"] if none else np.ones(case.n)), f64(d["gl"]),
            f64(case.label_smoothing), f64(case.z_loss), np.bool_(case.softcap is not None),
            f64(case.softcap or 1.0), np.int64(case.ignore_index))[case.reduction]
        return {k: np.asarray(a, np.float64) for k, a in out.items()}


ORACLES = {"torch": torch_oracle, "jax": jax_oracle}


# ----------------------------------------------------------------------------- cases
REDUCTIONS = ("mean", "sum", "none")
EVERYTHING = dict(bias=True, class_weight=True, label_smoothing=0.2, z_loss=1e-2, softcap=5.0,
                  lse_grad=True)
OPTION_SETS = {
    "plain": {},
    "bias": dict(bias=True),
    "class_weight": dict(class_weight=True),
    "smoothing": dict(label_smoothing=0.1),
    "smoothing1": dict(label_smoothing=1.0),           # the edge of [0, 1]
    "z_loss": dict(z_loss=1e-3),
    "softcap": dict(softcap=4.0),                       # logits of std 3: partly saturated
    "lse_grad": dict(lse_grad=True),
    "no_ignored": dict(ignore="none"),
    "ignore_minus1": dict(ignore_index=-1),
    "ignore_inside": dict(ignore_index=3),              # a real class id is ignored
    "ignore_above": dict(ignore_index=1000),            # >= V
    "weight_smoothing": dict(class_weight=True, label_smoothing=0.3),
    "softcap_z": dict(softcap=2.0, z_loss=0.05),
    "bias_softcap_lse": dict(bias=True, softcap=3.0, lse_grad=True),
    "weight_z_inside": dict(class_weight=True, z_loss=1e-2, ignore_index=5),
    # "mean" divides by Σω whatever its size or sign (F.cross_entropy's rule; 0 only for 0)
    "light_weights": dict(class_weight=True, weight_scale=0.01),   # Σω ≈ 0.3
    "negative_weights": dict(class_weight=True, weight_scale=-1.0),
    "everything": EVERYTHING,
    "everything_inside": dict(EVERYTHING, ignore_index=7, label_smoothing=0.9),
}
SHAPES = [
    (1, 16, 61),     # N = 1
    (1, 1, 2),       # the smallest problem with a choice
    (3, 4, 1),       # V = 1: one class, loss 0 unless z-loss
    (13, 9, 31),
    (64, 17, 101),   # N a multiple of 8, V prime
    (50, 8, 257),
    (9, 64, 1031),   # wider V, prime
]


def _cases():
    out = []
    for opts in OPTION_SETS.values():
        for red in REDUCTIONS:
            out.append(SpecCase(reduction=red, **opts))
    for n, h, v in SHAPES:
        for red in REDUCTIONS:
            out.append(SpecCase(n=n, h=h, v=v, reduction=red, ignore="none" if n == 1 else "some"))
            out.append(SpecCase(n=n, h=h, v=v, reduction=red, **EVERYTHING))
    return out


CASES = _cases()


def assert_close(name, got, want):
    assert_close_abs(name, got, want, rtol=RTOL, atol=ATOL)


def check_against(oracle, case):
    d = draw(case)
    ref = run_spec(case, d)
    want = ORACLES[oracle](case, d)
    for key in ("loss", "token_loss", "lse", "dz", "dx", "dw", "db"):
        assert_close(key, ref[key], want[key])
    return ref, d


@pytest.mark.parametrize("oracle", sorted(ORACLES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_matches_autodiff(oracle, case):
    check_against(oracle, case)


def test_cases_exercise_every_option():
    """The matrix above really covers each option, alone and mixed, with every reduction."""
    assert len(CASES) >= 20
    for red in REDUCTIONS:
        mine = [c for c in CASES if c.reduction == red]
        assert any(c.n == 1 for c in mine) and any(c.v == 1 for c in mine)
        assert any(c.h % 2 == 1 for c in mine) and any(c.n % 8 and c.v % 8 for c in mine)
        for c in (SpecCase(reduction=red, **o) for o in OPTION_SETS.values()):
            assert c in mine
    every = [c for c in CASES if c.bias and c.class_weight and c.label_smoothing and c.z_loss
             and c.softcap and c.lse_grad]
    assert {c.reduction for c in every} == set(REDUCTIONS)


# ----------------------------------------------------------------------------- all ignored
@pytest.mark.parametrize("red", REDUCTIONS)
@pytest.mark.parametrize("ignore_index", [-100, 4])
def test_all_ignored_is_zero_not_nan(red, ignore_index):
    case = SpecCase(reduction=red, ignore="all", ignore_index=ignore_index,
                    **dict(EVERYTHING, lse_grad=False))
    d = draw(case)
    r = run_spec(case, d)
    assert np.all(np.asarray(r["loss"]) == 0.0) and np.all(r["token_loss"] == 0.0)
    for key in ("dz", "dx", "dw", "db"):
        assert np.all(r[key] == 0.0), f"{key} is not exactly zero"
    assert np.isfinite(r["lse"]).all() and np.all(r["lse"] != 0)  # lse is still defined
    for oracle in ORACLES:
        check_against(oracle, case)
    if red == "mean":  # the case the spec defines differently from torch: torch gives 0/0
        import torch
        import torch.nn.functional as F
        t = torch.tensor
        torch_mean = F.cross_entropy(t(d["x"] @ d["W"].T), t(d["y"]),
                                     ignore_index=ignore_index)
        assert torch.isnan(torch_mean)


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("red", REDUCTIONS)
def test_minus_inf_bias_masks_classes_without_nan(red, eps):
    """A -inf bias masks classes (e.g. padded vocabulary): the reference equals float64 torch
    autograd on the same logits. Without label smoothing the loss is finite, also for ignored
    tokens (whose class-0 read must not become 0·inf); with it the masked classes' smoothing
    terms make the loss inf, as in F.cross_entropy."""
    import torch
    import torch.nn.functional as F
    rng = np.random.default_rng([SEED, 77])
    n, h, v = 7, 5, 11
    x, w = rng.standard_normal((n, h)), rng.standard_normal((v, h))
    b = rng.standard_normal(v)
    b[[0, 4, 9]] = -np.inf
    y = rng.choice([1, 2, 3, 5, 6, 7, 8, 10], n)
    y[[1, 5]] = -100
    cw = rng.uniform(0.5, 2.0, v)
    opts = spec.LinearCrossEntropyOptions(reduction=red, label_smoothing=eps)
    g = rng.standard_normal(n) if red == "none" else 1.3
    r = spec.reference(x, w, y, bias=b, weight=cw, options=opts, grad_output=g)
    t = lambda a: torch.tensor(a, requires_grad=True)
    xt, wt = t(x), t(w)
    loss = F.cross_entropy(xt @ wt.T + torch.tensor(b), torch.tensor(y), weight=torch.tensor(cw),
                           reduction=red, label_smoothing=eps)
    if eps:
        assert np.all(np.isinf(r["loss"][[0, 2, 3, 4, 6]] if red == "none" else r["loss"]))
        assert torch.isinf(loss[[0, 2, 3, 4, 6]] if red == "none" else loss).all()
        return
    assert np.isfinite(r["loss"]).all() and np.isfinite(r["dx"]).all()
    loss.backward(torch.tensor(g) if red == "none" else torch.tensor(g, dtype=torch.float64))
    np.testing.assert_allclose(r["loss"], loss.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(r["dx"], xt.grad.numpy(), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(r["dw"], wt.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("red", REDUCTIONS)
def test_all_ignored_lse_gradient_still_flows(red):
    """Ignored tokens carry no loss gradient, but their lse is an output with its own grad."""
    case = SpecCase(reduction=red, ignore="all", **EVERYTHING)
    ref, d = check_against("torch", case)
    check_against("jax", case)
    assert np.all(np.asarray(ref["loss"]) == 0.0) and np.all(ref["token_loss"] == 0.0)
    assert np.abs(ref["dx"]).max() > 0


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(reduction=None), ValueError, "reduction"),
    (dict(reduction="MEAN"), ValueError, "reduction"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing=float("nan")), TypeError, "label_smoothing"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing"),
    (dict(label_smoothing=True), TypeError, "label_smoothing"),
    (dict(z_loss=-1e-4), ValueError, "z_loss"),
    (dict(z_loss=float("inf")), TypeError, "z_loss"),
    (dict(z_loss=None), TypeError, "z_loss"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=0), ValueError, "softcap"),
    (dict(softcap=-30.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), TypeError, "softcap"),
    (dict(softcap=float("nan")), TypeError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
    # finite in float64 but outside float32's normal range: the kernels' z/softcap would be
    # 0 or inf in float32, and their gradients NaN
    (dict(softcap=1e39), ValueError, "softcap must lie in float32's normal range"),
    (dict(softcap=1e-39), ValueError, "softcap must lie in float32's normal range"),
    (dict(ignore_index=-100.0), TypeError, "ignore_index"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(ignore_index="-100"), TypeError, "ignore_index"),
    (dict(ignore_index=True), TypeError, "ignore_index"),
    (dict(ignore_index=None), TypeError, "ignore_index"),
    # beyond any integer target dtype (torch's ops had answered "Expected int, found int")
    (dict(ignore_index=2 ** 63), ValueError, "ignore_index must fit in int64"),
    (dict(ignore_index=-2 ** 63 - 1), ValueError, "ignore_index must fit in int64"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
    (dict(return_lse=None), TypeError, "return_lse"),
])
def test_options_reject_bad_values(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        spec.LinearCrossEntropyOptions(**kwargs)


def test_options_accept_edges_and_normalize():
    o = spec.LinearCrossEntropyOptions(label_smoothing=1, z_loss=0, softcap=1e-6,
                                       ignore_index=np.int32(7), return_lse=True)
    for edge in (2 ** 63 - 1, -2 ** 63):
        assert spec.LinearCrossEntropyOptions(ignore_index=edge).ignore_index == edge
    for cap in (spec.FLOAT32_TINY, spec.FLOAT32_MAX):
        assert spec.LinearCrossEntropyOptions(softcap=cap).softcap == cap
    assert o.ignore_index == 7 and type(o.ignore_index) is int
    # a NumPy bool (e.g. from a config array) as NumPy numbers are: normalized to bool
    assert spec.LinearCrossEntropyOptions(return_lse=np.True_).return_lse is True
    assert spec.LinearCrossEntropyOptions(label_smoothing=0.0).uses_smoothing is False
    assert o.uses_smoothing is True
    for red in REDUCTIONS:
        assert spec.LinearCrossEntropyOptions(reduction=red).reduction == red
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.reduction = "sum"


# ----------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("args, kw, name", [
    (((), (5, 3), ()), {}, "input"),
    (((4, 3), (15,), (4,)), {}, "linear_weight"),
    (((4, 3), (1, 5, 3), (4,)), {}, "linear_weight"),
    (((4, 3), (5, 4), (4,)), {}, "hidden size"),
    (((4, 3), (0, 3), (4,)), {}, "linear_weight"),
    (((4, 0), (5, 0), (4,)), {}, "linear_weight"),
    (((4, 3), (5, 3), (3,)), {}, "target"),
    (((2, 4, 3), (5, 3), (8,)), {}, "target"),
    (((2, 4, 3), (5, 3), (2, 4, 1)), {}, "target"),
    (((4, 3), (5, 3), (4,), (6,)), {}, "linear_bias"),
    (((4, 3), (5, 3), (4,), (1, 5)), {}, "linear_bias"),
    (((4, 3), (5, 3), (4,), None, (4,)), {}, "weight"),
    (((4, 3), (5, 3), (4,), None, (5, 1)), {}, "weight"),
    (((4, 3), (5, 3), (4,)), dict(weight_layout="hv"), "hidden size"),
    (((4, 3), (5, 3), (4,)), dict(weight_layout="VH"), "weight_layout"),
])
def test_check_shapes_names_the_argument(args, kw, name):
    with pytest.raises(ValueError, match=name):
        spec.check_shapes(*args, **kw)


def test_check_shapes_hidden_mismatch_names_both():
    with pytest.raises(ValueError) as e:
        spec.check_shapes((4, 3), (5, 4), (4,))
    assert "input" in str(e.value) and "linear_weight" in str(e.value)


def test_check_shapes_problem():
    p = spec.check_shapes((2, 7, 3), (5, 3), (2, 7), (5,), (5,))
    assert (p.n, p.h, p.v, p.batch_shape) == (14, 3, 5, (2, 7))
    p = spec.check_shapes((2, 7, 3), (3, 5), (2, 7), weight_layout="hv")
    assert (p.n, p.h, p.v) == (14, 3, 5)
    p = spec.check_shapes((3,), (5, 3), ())           # one unbatched token
    assert (p.n, p.batch_shape) == (1, ())
    assert spec.check_shapes((0, 3), (5, 3), (0,)).n == 0


# ----------------------------------------------------------------------------- targets
@pytest.mark.parametrize("bad, ii", [(5, -100), (-1, -100), (-100, -1), (10**6, -100), (5, 4)])
def test_check_targets_rejects_out_of_range(bad, ii):
    y = np.array([0, 4, bad, 2])
    with pytest.raises(ValueError, match=r"target out of range.*\[0, 5\)") as e:
        spec.check_targets(y, 5, ii)
    assert f"found {bad}" in str(e.value) and f"ignore_index={ii}" in str(e.value)
    x, W = np.ones((4, 3)), np.ones((5, 3))
    with pytest.raises(ValueError, match="target out of range"):
        spec.reference(x, W, y, options=spec.LinearCrossEntropyOptions(ignore_index=ii))


@pytest.mark.parametrize("y", [np.array([0.0, 1.0]), np.array([True, False]),
                               np.array([0, 1], dtype=np.complex64)])
def test_check_targets_rejects_non_integer(y):
    with pytest.raises(TypeError, match="target"):
        spec.check_targets(y, 5, -100)


@pytest.mark.parametrize("ii", [-100, -1, 3, 5, 77])
def test_check_targets_accepts_valid(ii):
    for dt in (np.int64, np.int32, np.uint8):
        y = np.array([0, 4, 2, 3], dtype=dt)
        spec.check_targets(y, 5, ii)
    spec.check_targets(np.array([ii, 0, ii]), 5, ii)     # ignore_index anywhere is fine
    spec.check_targets(np.zeros((0,), np.int64), 5, ii)  # no tokens


def test_reference_rejects_float_targets():
    """The reference itself must not truncate float targets to class ids before checking."""
    x, W = np.ones((2, 3)), np.ones((5, 3))
    with pytest.raises(TypeError, match="target"):
        spec.reference(x, W, np.array([0.7, 1.2]))
