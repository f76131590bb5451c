"""Tiled MLP: the spec, the PyTorch paths (fused SwiGLU ops, generic autograd.Function), the
JAX custom_vjp, against the float64 reference and each other; the PyTorch semantics that
peers get wrong (gradient hooks fire once, earlier micro-batch gradients kept, checkpoint,
frozen parameters, autocast); the JAX compiled temp memory of one shard.

Tolerance: the shared harness's rule (``harness.compare``), relative error against float64
within ``FACTOR`` × the naive untiled MLP's error in the same dtype (``F.silu(g) * u`` with
autograd / jnp with autodiff), never below the dtype's floor. The DDP test is in test_tiled_mlp_ddp.py.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import zlib
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import jax
import jax.numpy as jnp

import logitless.jax as lj
import logitless.torch as lt
from harness import FACTOR, FLOOR, NP_DTYPES, SEED, compare, rel_err
from helpers import no_host_sync
from logitless.specs import tiled_mlp as spec

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
NAMES = {"w_gate": "gate_proj.weight", "w_up": "up_proj.weight", "w_down": "down_proj.weight",
         "b_gate": "gate_proj.bias", "b_up": "up_proj.bias", "b_down": "down_proj.bias"}


# ----------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    shape: tuple                 # x: [..., T, H]
    i: int                       # intermediate size
    dtype: str = "float32"
    bias: bool = False
    num_shards: Optional[int] = None
    accum_fp32: bool = True

    @property
    def id(self):
        s = f"{'x'.join(map(str, self.shape))}-I{self.i}-{self.dtype}-S{self.num_shards}"
        return s + ("-bias" if self.bias else "") + ("" if self.accum_fp32 else "-accum_param")


CASES = [
    Case((2, 53, 24), 70, "bfloat16", bias=True, num_shards=4),  # B·T=106: 27,27,27,25
    Case((53, 24), 70, "float32"),                                # default ceil(53/24) = 3
    Case((1, 40, 16), 48, "float16", num_shards=7),               # shards of 6, last 4
    Case((7, 16), 33, "float32", bias=True, num_shards=1),        # one shard
    Case((2, 30, 16), 40, "bfloat16", num_shards=5, accum_fp32=False),
]


def make_inputs(case: Case, salt=0):
    """x, parameters (torch layout) and dy, rounded to the case dtype (as float32 arrays)."""
    rng = np.random.default_rng([SEED, salt, zlib.crc32(case.id.encode())])
    dt = NP_DTYPES[case.dtype]
    h = case.shape[-1]
    r = lambda shape, scale: (rng.standard_normal(shape) * scale).astype(dt).astype(np.float32)
    # gate/up pre-activations of std ~2: both tails of the sigmoid matter
    p = {"w_gate": r((case.i, h), 2 / np.sqrt(h)), "w_up": r((case.i, h), 1 / np.sqrt(h)),
         "w_down": r((h, case.i), 1 / np.sqrt(case.i))}
    if case.bias:
        p.update(b_gate=r(case.i, 0.5), b_up=r(case.i, 0.5), b_down=r(h, 0.5))
    return r(case.shape, 1.0), p, r(case.shape, 1.0)


def reference(x, p, dy, num_shards=None):
    return spec.swiglu_mlp_reference(x, p, dy, num_shards=num_shards)


# ----------------------------------------------------------------------------- torch runners
class LlamaMLP(nn.Module):
    """The plain MLP a user has (no logitless inside): the generic path's subject."""

    def __init__(self, h, i, bias=False, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=bias, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def torch_module(cls, case, p, device=DEV):
    m = cls(case.shape[-1], case.i, bias=case.bias, dtype=getattr(torch, case.dtype)).to(device)
    with torch.no_grad():
        for k, v in p.items():
            m.get_parameter(NAMES[k]).copy_(torch.tensor(v))
    return m


def torch_run(case, x, p, dy, *, cls=lt.SwiGLUMLP, tiled=True):
    dt = getattr(torch, case.dtype)
    m = torch_module(cls, case, p)
    xt = torch.tensor(x, dtype=dt, device=DEV).requires_grad_()
    if tiled:
        y = lt.tiled_mlp(m, xt, num_shards=case.num_shards,
                         grad_accum_dtype=torch.float32 if case.accum_fp32 else None)
    else:
        y = m(xt)
    y.backward(torch.tensor(dy, dtype=dt, device=DEV))
    f = lambda t: t.detach().double().cpu().numpy()
    out = {"y": f(y), "dx": f(xt.grad)}
    out.update({"d" + k: f(m.get_parameter(NAMES[k]).grad) for k in p})
    return out


# ----------------------------------------------------------------------------- jax runners
def jax_params(p, dtype):
    a = lambda v: jnp.asarray(v, jnp.dtype(dtype))
    out = {}
    for proj in ("gate", "up", "down"):
        d = {"kernel": a(p["w_" + proj].T)}
        if "b_" + proj in p:
            d["bias"] = a(p["b_" + proj])
        out[proj + "_proj"] = d
    return out


def _rounded(a):
    """``a`` rounded to its dtype's grid, as a GPU materializes it (XLA on CPU may keep more)."""
    fi = jnp.finfo(a.dtype)
    return jax.lax.reduce_precision(a, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def naive_jax_mlp(params, x):
    dense = lambda v, q: _rounded(v @ q["kernel"] + q["bias"] if "bias" in q else v @ q["kernel"])
    g, u = dense(x, params["gate_proj"]), dense(x, params["up_proj"])
    return dense(_rounded(_rounded(jax.nn.silu(g)) * u), params["down_proj"])


def jax_run(case, x, p, dy, fn, tiled=True):
    dt = jnp.dtype(case.dtype)
    params = jax_params(p, case.dtype)

    def apply(params, x):
        if not tiled:
            return fn(params, x)
        return lj.tiled_mlp(fn, params, x, num_shards=case.num_shards,
                            grad_accum_dtype=jnp.float32 if case.accum_fp32 else None)

    def fwd_bwd(params, x, dy):  # one program: the forward and the vjp
        y, vjp = jax.vjp(apply, params, x)
        return (y,) + vjp(dy)

    y, dp, dx = jax.jit(fwd_bwd)(params, jnp.asarray(x, dt), jnp.asarray(dy, dt))
    f = lambda a: np.asarray(a, np.float64)
    out = {"y": f(y), "dx": f(dx)}
    for k in p:
        kind, proj = k.split("_")
        out["d" + k] = f(dp[proj + "_proj"]["kernel" if kind == "w" else "bias"]).T
    return out


# ----------------------------------------------------------------------------- spec
def test_plan_shards():
    plan = spec.plan_shards((2, 53, 24), 4)
    assert (plan.n, plan.shard, plan.num_shards, plan.full_shards, plan.tail) == (106, 27, 4, 3, 25)
    assert plan.bounds() == [(0, 27), (27, 54), (54, 81), (81, 106)]
    assert spec.plan_shards((32768, 4096)).num_shards == 8  # ceil(T / H)
    assert spec.plan_shards((4, 32768, 4096)).shard == 4 * 4096  # default counts T, not B·T
    assert spec.plan_shards((10, 4), 6).bounds() == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert spec.plan_shards((3, 8), 100).shard == 1  # at least one token per shard
    assert spec.plan_shards((0, 8)).bounds() == []
    assert spec.shard_shape((2, 53, 24), 27) == (1, 27, 24)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_shards"):
            spec.plan_shards((5, 4), bad)
    with pytest.raises(ValueError, match=r"\[\.\.\., T, H\]"):
        spec.plan_shards((5,))


@pytest.mark.parametrize("num_shards", [1, 3, 106])
def test_spec_reference_matches_float64_autodiff(num_shards):
    """The tiled float64 reference == autograd of the untiled MLP in float64 (torch)."""
    case = Case((2, 53, 24), 70, bias=True)
    x, p, dy = make_inputs(case, salt=1)
    ref = reference(x, p, dy, num_shards=num_shards)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in p.items()}
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = F.linear(F.silu(F.linear(xt, t["w_gate"], t["b_gate"])) *
                 F.linear(xt, t["w_up"], t["b_up"]), t["w_down"], t["b_down"])
    y.backward(torch.tensor(dy, dtype=torch.float64))
    want = {"y": y, "dx": xt.grad, **{"d" + k: v.grad for k, v in t.items()}}
    assert set(want) == set(ref)
    for k, v in want.items():
        np.testing.assert_allclose(ref[k], v.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg=k)


# ----------------------------------------------------------------------------- torch: accuracy
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_fused_matches_float64(case):
    x, p, dy = make_inputs(case)
    naive = torch_run(case, x, p, dy, cls=LlamaMLP, tiled=False)
    compare(case.dtype, torch_run(case, x, p, dy), reference(x, p, dy), naive)


def torch_run_naive_per_shard(case, x, p, dy):
    """The naive MLP run shard by shard through autograd, its shard gradients summed in fp64
    and returned in the parameter dtype, as any gradient is: the error scale of the generic
    path, whose parameter gradients reach it per shard already rounded to the parameter dtype
    (a bias gradient of a few dozen elements, summed from rounded partials, can otherwise
    exceed twice the untiled error by chance). Without that final rounding the scale missed
    one rounding every tiled result has: 7 failures in 300 seeds of the bf16 case, 0 with it."""
    dt = getattr(torch, case.dtype)
    m = torch_module(LlamaMLP, case, p)
    plan = spec.plan_shards(x.shape, case.num_shards)
    x2 = torch.tensor(x, dtype=dt, device=DEV).reshape(plan.n, -1)
    dy2 = torch.tensor(dy, dtype=dt, device=DEV).reshape(plan.n, -1)
    acc = {k: 0.0 for k in p}
    ys, dxs = [], []
    for s, e in plan.bounds():
        xs = x2[s:e].clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = m(xs)
        y.backward(dy2[s:e])
        ys.append(y.detach())
        dxs.append(xs.grad)
        acc = {k: acc[k] + m.get_parameter(NAMES[k]).grad.double() for k in p}
    f = lambda t: t.detach().double().cpu().numpy()
    out = {"y": f(torch.cat(ys)).reshape(x.shape), "dx": f(torch.cat(dxs)).reshape(x.shape)}
    out.update({"d" + k: f(v.to(dt)) for k, v in acc.items()})
    return out


@pytest.mark.parametrize("case", CASES[:2] + CASES[4:], ids=lambda c: c.id)
def test_torch_generic_matches_float64(case):
    x, p, dy = make_inputs(case)
    naive = torch_run_naive_per_shard(case, x, p, dy)
    compare(case.dtype, torch_run(case, x, p, dy, cls=LlamaMLP), reference(x, p, dy), naive)


def test_fp32_accumulation_beats_param_dtype_accumulation():
    """With many shards, summing bf16 per-shard weight gradients in bf16 loses accuracy;
    grad_accum_dtype=torch.float32 stays within the harness tolerance of the untiled MLP."""
    case = Case((1, 128, 16), 32, "bfloat16", num_shards=16)
    x, p, dy = make_inputs(case, salt=2)
    ref = reference(x, p, dy)
    naive = torch_run(case, x, p, dy, cls=LlamaMLP, tiled=False)
    fp32 = torch_run(case, x, p, dy)
    bf16 = torch_run(dataclasses.replace(case, accum_fp32=False), x, p, dy)
    compare(case.dtype, fp32, ref, naive)
    for k in ("dw_gate", "dw_up", "dw_down"):
        assert rel_err(fp32[k], ref[k]) < rel_err(bf16[k], ref[k]), k


def test_torch_default_sums_in_the_parameter_dtype():
    """The default is grad_accum_dtype=None: the very same gradients, bit for bit."""
    case = Case((1, 64, 16), 32, "bfloat16", num_shards=8, accum_fp32=False)
    x, p, dy = make_inputs(case, salt=3)
    explicit = torch_run(case, x, p, dy)
    m = torch_module(lt.SwiGLUMLP, case, p)
    xt = torch.tensor(x, dtype=torch.bfloat16, device=DEV).requires_grad_()
    lt.tiled_mlp(m, xt, num_shards=8).backward(torch.tensor(dy, dtype=torch.bfloat16, device=DEV))
    for k in p:
        np.testing.assert_array_equal(
            m.get_parameter(NAMES[k]).grad.double().cpu().numpy(), explicit["d" + k], err_msg=k)


# ----------------------------------------------------------------------------- torch: semantics
def _small(cls=lt.SwiGLUMLP, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(SEED + seed)
    m = cls(16, 40, bias=bias, dtype=dtype).to(DEV)
    x = torch.randn(2, 21, 16, dtype=dtype, device=DEV)
    return m, x


def assert_fp32_close(a, b):
    """Equal up to fp32 summation order, norm-wise (single elements may cancel)."""
    assert a.shape == b.shape and torch.isfinite(a).all()
    err = rel_err(a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy())
    assert err <= FLOOR["float32"], err


def _grads(m, x, fn, dy=None):
    m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(torch.ones_like(y) if dy is None else dy)
    return y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("cls", [lt.SwiGLUMLP, LlamaMLP], ids=["fused", "generic"])
def test_each_parameter_hook_fires_once_with_the_full_gradient(cls):
    m, x = _small(cls)
    _, _, untiled = _grads(m, x, m)
    calls = {n: [] for n, _ in m.named_parameters()}
    for n, p in m.named_parameters():
        p.register_hook(lambda g, n=n: calls[n].append(("hook", g.clone())))
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls[n].append(("post", None)))
    _grads(m, x, lambda x: lt.tiled_mlp(m, x, num_shards=5))
    for n, p in m.named_parameters():
        assert [c[0] for c in calls[n]] == ["hook", "post"], n
        assert_fp32_close(calls[n][0][1], untiled[n])


@pytest.mark.parametrize("cls", [lt.SwiGLUMLP, LlamaMLP], ids=["fused", "generic"])
def test_micro_batches_accumulate_into_existing_grads(cls):
    m, x = _small(cls, seed=1)
    x2 = torch.randn_like(x)
    tiled = lambda x: lt.tiled_mlp(m, x, num_shards=3)
    _, _, g1 = _grads(m, x, tiled)
    _, _, g2 = _grads(m, x2, tiled)
    m.zero_grad(set_to_none=True)
    for xb in (x, x2):  # two micro-batches, no zero_grad between them
        tiled(xb.requires_grad_()).sum().backward()
    for n, p in m.named_parameters():
        # Not bit-exact on CUDA (cuBLAS may pick another algorithm for the second call); a
        # dropped micro-batch would be off by a whole gradient, far beyond this tolerance.
        torch.testing.assert_close(p.grad, g1[n] + g2[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("cls", [lt.SwiGLUMLP, LlamaMLP], ids=["fused", "generic"])
def test_under_activation_checkpointing(cls, use_reentrant):
    m, x = _small(cls, seed=2)
    tiled = lambda x: lt.tiled_mlp(m, x, num_shards=4)
    want = _grads(m, x, tiled)
    got = _grads(m, x, lambda x: checkpoint(tiled, x, use_reentrant=use_reentrant))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0)


@pytest.mark.parametrize("cls", [lt.SwiGLUMLP, LlamaMLP], ids=["fused", "generic"])
def test_frozen_parameters_and_input(cls):
    m, x = _small(cls, seed=3)
    _, _, full = _grads(m, x, m)
    frozen = ("gate_proj.weight", "down_proj.bias")
    for n in frozen:
        m.get_parameter(n).requires_grad_(False)
    m.zero_grad(set_to_none=True)
    y = lt.tiled_mlp(m, x, num_shards=3)  # x needs no gradient either
    y.sum().backward()
    for n, p in m.named_parameters():
        if n in frozen:
            assert p.grad is None, n
        else:
            assert_fp32_close(p.grad, full[n])


@pytest.mark.parametrize("cls", [lt.SwiGLUMLP, LlamaMLP], ids=["fused", "generic"])
def test_double_backward_is_a_clear_error(cls):
    """create_graph=True raises, also when the incoming gradient does not require grad:
    once_differentiable had let it through on the generic path (a gradient penalty became
    0, silently) and the fused path gave PyTorch's 'no autograd formula' message."""
    m, x = _small(cls, seed=5)
    x = x.detach().requires_grad_()
    with pytest.raises(RuntimeError, match="tiled_mlp has no double backward"):
        torch.autograd.grad(lt.tiled_mlp(m, x, num_shards=3).sum(), x, create_graph=True)


class _TwiceRegistered(nn.Module):
    """One Linear under two names (``self.b = self.a``) and one Parameter in two modules."""

    def __init__(self, h):
        super().__init__()
        self.a = nn.Linear(h, h)
        self.b = self.a
        self.c, self.d = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.d.weight = self.c.weight

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def test_generic_path_with_shared_submodules_and_parameters_trains_like_untiled():
    """torch.func.functional_call had left a twice-registered submodule holding the backward's
    detached alias: the Parameter got no gradient from the second step on (3 SGD steps:
    the tiled loss stalled at the second step's value)."""
    torch.manual_seed(SEED % 2**31)
    untiled = _TwiceRegistered(8).double()
    tiled = copy.deepcopy(untiled)
    params = dict(tiled.named_parameters())
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    for step in range(3):
        for m, fn in ((untiled, untiled), (tiled, lambda x: lt.tiled_mlp(tiled, x, num_shards=4))):
            m.zero_grad(set_to_none=True)
            loss = fn(x).square().sum()
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.05 * p.grad
        assert dict(tiled.named_parameters()) == params  # the same Parameter objects
        assert all(type(p) is nn.Parameter for p in tiled.parameters())
        for (n, p), q in zip(tiled.named_parameters(), untiled.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=f"step {step}: {n}")


def test_only_the_input_needs_a_gradient():
    m, x = _small(seed=4)
    _, dx, _ = _grads(m, x, m)
    m.requires_grad_(False)
    xg = x.detach().requires_grad_()
    lt.tiled_mlp(m, xg, num_shards=3).sum().backward()
    assert_fp32_close(xg.grad, dx)


def test_module_form_and_shard_shapes_seen_by_the_mlp():
    seen = []

    class Recording(LlamaMLP):
        def forward(self, x):
            seen.append((tuple(x.shape), torch.is_grad_enabled()))
            return super().forward(x)

    m, x = _small(Recording, seed=5)
    wrapper = lt.TiledMLP(m, num_shards=4)
    assert [n for n, _ in wrapper.named_parameters()][0] == "mlp.gate_proj.weight"
    y, _, grads = _grads(m, x, wrapper)
    fwd = [((1, 11, 16), False)] * 3 + [((1, 9, 16), False)]  # 42 tokens: 11, 11, 11, 9
    assert seen == fwd + [(s, True) for s, _ in fwd]  # forward, then the recompute
    seen.clear()
    want = _grads(m, x, m)
    assert_fp32_close(y, want[0])
    for n in grads:
        assert_fp32_close(grads[n], want[2][n])


def test_generic_path_recomputes_under_the_forward_autocast_state():
    states = []

    class Recording(LlamaMLP):
        def forward(self, x):
            states.append(torch.is_autocast_enabled(x.device.type))
            return super().forward(x)

    m, x = _small(Recording, seed=6)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        y = lt.tiled_mlp(m, x.requires_grad_(), num_shards=2)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()  # outside autocast
    assert states == [True] * 4
    assert x.grad.dtype == torch.float32 and m.gate_proj.weight.grad.dtype == torch.float32


def test_fused_path_is_taken_only_for_a_plain_swiglu_mlp(monkeypatch):
    from logitless import tiled_mlp_torch as tmt
    calls = []
    real = tmt._TiledFunction.apply
    monkeypatch.setattr(tmt._TiledFunction, "apply", lambda *a: calls.append(1) or real(*a))
    m, x = _small(seed=7)
    lt.tiled_mlp(m, x, num_shards=2)
    assert calls == []  # fused
    m.register_forward_hook(lambda mod, inp, out: None)
    lt.tiled_mlp(m, x, num_shards=2)
    assert calls == [1]  # a hook must run: generic


@pytest.mark.parametrize("change", ["backward_hook", "backward_pre_hook", "linear_backward_hook",
                                    "instance_forward", "linear_instance_forward"])
def test_hooks_and_instance_forwards_take_the_generic_path(change):
    """The fused path never calls the modules: a backward hook (on the MLP or a projection) or a
    forward set on an instance (accelerate's add_hook_to_module does that) must take the
    generic path, which runs them, and give what the untiled module gives. The fused path had
    skipped them silently (hooks never fired; an override was ignored)."""
    m, x = _small(seed=9)
    fired = []
    if change == "backward_hook":
        m.register_full_backward_hook(lambda mod, gi, go: fired.append(1))
    elif change == "backward_pre_hook":
        m.register_full_backward_pre_hook(lambda mod, go: fired.append(1))
    elif change == "linear_backward_hook":
        m.down_proj.register_full_backward_hook(lambda mod, gi, go: fired.append(1))
    else:
        lin = m if change == "instance_forward" else m.gate_proj
        plain = lin.forward
        lin.forward = lambda t: 2.0 * plain(t)
    want = _grads(m, x, m)
    fired_untiled, fired[:] = len(fired), []
    got = _grads(m, x, lambda t: lt.tiled_mlp(m, t, num_shards=2))
    if change.endswith("hook"):
        assert fired_untiled == 1 and len(fired) >= 1
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n])


def test_generic_path_refuses_a_hook_that_replaces_a_parameter():
    """Hooks that install parameters for the forward (FSDP2 on the MLP inside the tiled call,
    accelerate's offload hooks) replace the backward's alias in the recompute: the recompute
    then runs on a tensor whose gradient the tiled backward never collects. It had given None
    gradients silently; now an error, raised before any gradient lands."""
    m, x = _small(LlamaMLP, seed=14)
    lin = m.up_proj
    stored = lin.weight  # as FSDP2: gathered copy for the forward, the stored one after

    lin.register_forward_pre_hook(
        lambda mod, args: mod._parameters.__setitem__("weight", nn.Parameter(stored.detach() * 1)))
    lin.register_forward_hook(lambda mod, args, out: mod._parameters.__setitem__("weight", stored))
    y = lt.tiled_mlp(m, x.requires_grad_(), num_shards=3)
    with pytest.raises(RuntimeError, match=r"a hook replaced the parameter 'weight' of Linear.*"
                                           r"shard the TiledMLP module or an outer module"):
        y.sum().backward()
    assert x.grad is None and all(p.grad is None for p in m.parameters())
    assert lin.weight is stored and type(m.gate_proj.weight) is nn.Parameter  # restored


class _LoRALinear(nn.Module):
    """A frozen base Linear plus trainable rank-2 adapters (PEFT's LoRA layout)."""

    def __init__(self, i, o):
        super().__init__()
        self.base = nn.Linear(i, o).requires_grad_(False)
        self.lora_a, self.lora_b = nn.Linear(i, 2, bias=False), nn.Linear(2, o, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class _LoRAMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = _LoRALinear(16, 24), _LoRALinear(24, 16)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def test_generic_path_lets_a_hook_swap_a_frozen_parameter():
    """accelerate's offload hooks (AlignDevicesHook) on a LoRA's frozen base Linear install its
    weight before each forward and restore the stored one after. The frozen weight's gradient
    is wanted by nobody, so the swap loses nothing: the adapters and x get the untiled
    gradients (the swap check had refused every swapped parameter, frozen ones too)."""
    torch.manual_seed(SEED + 17)
    m = _LoRAMLP().to(DEV)
    for lin in (m.up.base, m.down.base):
        stored = lin.weight
        lin.register_forward_pre_hook(lambda mod, args, st=stored: mod._parameters.__setitem__(
            "weight", nn.Parameter(st.detach().clone(), requires_grad=False)))
        lin.register_forward_hook(
            lambda mod, args, out, st=stored: mod._parameters.__setitem__("weight", st))
    x = torch.randn(2, 21, 16, device=DEV)
    y_full, dx_full, full = _grads(m, x, m)
    y, dx, got = _grads(m, x, lambda t: lt.tiled_mlp(m, t, num_shards=3))
    assert_fp32_close(y, y_full)
    assert_fp32_close(dx, dx_full)
    for n, p in m.named_parameters():
        if "base" in n:
            assert got[n] is None and full[n] is None, n
        else:
            assert_fp32_close(got[n], full[n])


class _ComputedWeight(nn.Module):
    """An MLP reading a tensor that requires grad but is not its registered parameter."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return torch.tanh(x @ self.w)


def _flat_views_like_fsdp1(m):
    """What FSDP1 (use_orig_params=False) installs for the forward: each parameter deleted and
    replaced by a plain-tensor view of one flat leaf, which alone receives the gradient."""
    slots = [(mod, n, p) for mod in m.modules() for n, p in list(mod._parameters.items())]
    flat = torch.cat([p.detach().reshape(-1) for _, _, p in slots]).requires_grad_()
    off = 0
    for mod, n, p in slots:
        delattr(mod, n)
        setattr(mod, n, flat[off:off + p.numel()].view(p.shape))
        off += p.numel()
    return flat


@pytest.mark.parametrize("kind", ["computed_weight", "tensor_attribute", "fsdp1_flat_views"])
def test_generic_path_refuses_a_tensor_that_is_not_a_registered_parameter(kind):
    """Its gradient cannot leave the tiled call (the backward returns gradients for x and the
    registered parameters only): the tiled call had returned None for it, silently."""
    torch.manual_seed(SEED + 15)
    x = torch.randn(2, 9, 8, device=DEV, requires_grad=True)
    base = torch.randn(8, 8, device=DEV, requires_grad=True)
    if kind == "computed_weight":
        m = _ComputedWeight(base * 1.0)  # a non-leaf
    elif kind == "tensor_attribute":
        m = _ComputedWeight(base)  # a leaf, not registered
    else:
        m = LlamaMLP(8, 12, bias=True).to(DEV)
        _flat_views_like_fsdp1(m)
    m(x).sum().backward()  # untiled, the tensor gets a gradient
    with pytest.raises(RuntimeError, match="neither x nor a parameter registered in the MLP"):
        lt.tiled_mlp(m, x, num_shards=3).sum().backward()


def test_fused_path_gives_fsdp1_flat_views_their_gradient():
    """The fused path takes the weights as op inputs, so the views' gradients reach the flat
    parameter as untiled (the generic path refuses them, test above)."""
    torch.manual_seed(SEED + 16)
    m = lt.SwiGLUMLP(8, 12, bias=True).to(DEV)
    flat = _flat_views_like_fsdp1(m)
    x = torch.randn(2, 9, 8, device=DEV, requires_grad=True)
    m(x).square().sum().backward()
    want, flat.grad = flat.grad, None
    lt.tiled_mlp(m, x, num_shards=3).square().sum().backward()
    assert_fp32_close(flat.grad, want)


def test_empty_sequence():
    """No tokens: zero gradients for every parameter on both paths, as the untiled module
    gets (a None on one rank would leave DDP waiting for its gradient)."""
    for cls in (lt.SwiGLUMLP, LlamaMLP):
        m, _ = _small(cls)
        x = torch.randn(2, 0, 16, device=DEV, requires_grad=True)
        y = lt.tiled_mlp(m, x)
        assert y.shape == (2, 0, 16)
        y.sum().backward()
        assert x.grad.shape == x.shape
        for n, p in m.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any(), n


def test_torch_compile_fullgraph_traces_the_fused_path():
    m, x = _small(seed=8)
    wrapper = lt.TiledMLP(m, num_shards=3)
    want = _grads(m, x, wrapper)
    compiled = torch.compile(wrapper, backend="aot_eager", fullgraph=True)
    got = _grads(m, x, compiled)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0)


class _DropoutMLP(nn.Module):
    def __init__(self, h, i, bias=True, dtype=None):
        super().__init__()
        self.up, self.down = nn.Linear(h, i, bias=bias, dtype=dtype), nn.Linear(i, h, dtype=dtype)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.down(self.drop(F.gelu(self.up(x))))


def test_generic_path_replays_the_forward_dropout_masks():
    """Backward recomputes each shard with the RNG state of the forward (as
    torch.utils.checkpoint does): the gradients are those of the masks the forward drew,
    i.e. of the module run shard by shard untiled from the same seed; the RNG stream after
    backward is as if backward had drawn nothing."""
    m, x = _small(_DropoutMLP, seed=11)
    shards = 3  # 42 tokens: 14 each
    torch.manual_seed(SEED + 1)
    y, dx, grads = _grads(m, x, lambda x: lt.tiled_mlp(m, x, num_shards=shards))
    after = torch.rand(4, device=DEV)
    torch.manual_seed(SEED + 1)
    want = _grads(m, x, lambda x: torch.cat([m(t) for t in x.reshape(1, 42, 16).chunk(shards, 1)],
                                            1).reshape(x.shape))
    assert torch.equal(torch.rand(4, device=DEV), after)
    assert_fp32_close(y, want[0])
    assert_fp32_close(dx, want[1])
    for n in grads:
        assert_fp32_close(grads[n], want[2][n])
    with torch.no_grad():
        assert rel_err(y.double().cpu().numpy(), m.eval()(x).double().cpu().numpy()) > 0.1


def test_fused_path_under_autocast_traces_fullgraph(monkeypatch):
    """Under autocast a SwiGLUMLP keeps the fused path (x and the weights cast as F.linear
    would, gradients reaching the fp32 parameters); torch.compile(fullgraph=True) traces it,
    and it matches the untiled MLP under the same autocast."""
    from logitless import tiled_mlp_torch as tmt
    calls = []
    real = tmt._TiledFunction.apply
    monkeypatch.setattr(tmt._TiledFunction, "apply", lambda *a: calls.append(1) or real(*a))
    m, x = _small(seed=12)
    wrapper = lt.TiledMLP(m, num_shards=3)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        want = _grads(m, x, m)
        got = _grads(m, x, wrapper)
        torch._dynamo.reset()
        compiled = _grads(m, x, torch.compile(wrapper, backend="aot_eager", fullgraph=True))
    assert calls == []  # fused, not generic
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    # float64 reference on the operands autocast gives F.linear (rounded to bf16)
    m64 = copy.deepcopy(m).double()
    with torch.no_grad():
        for p in m64.parameters():
            p.copy_(p.bfloat16())
    ref = _grads(m64, x.bfloat16().double(), m64)
    f = lambda t: t.double().cpu().numpy()
    for name, a, b, c, r in [("y", got[0], want[0], compiled[0], ref[0]),
                             ("dx", got[1], want[1], compiled[1], ref[1])] + [
            (n, got[2][n], want[2][n], compiled[2][n], ref[2][n]) for n in want[2]]:
        assert b.dtype == a.dtype == c.dtype and torch.isfinite(a).all(), name
        err, naive = rel_err(f(a), f(r)), rel_err(f(b), f(r))
        assert err <= max(FACTOR * naive, FLOOR["bfloat16"]), (name, err, naive)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


def test_forward_mode_ad_is_refused_not_zero():
    """jvp / jacfwd through the fused ops (which register only a backward) would give a zero
    tangent: refused, naming the argument that carries one."""
    m, x = _small(seed=13)
    with pytest.raises(NotImplementedError, match=r"tiled_mlp .*forward-mode AD.*\bx\b"):
        torch.func.jvp(lambda x: lt.tiled_mlp(m, x), (x,), (torch.ones_like(x),))
    w = m.up_proj.weight.detach()
    with pytest.raises(NotImplementedError, match=r"tiled_mlp .*: up_proj\.weight carries"):
        torch.func.jvp(lambda w: torch.func.functional_call(
            lt.TiledMLP(m), {"mlp.up_proj.weight": w}, (x,)), (w,), (torch.ones_like(w),))
    g = x[0, :4, :8]
    with pytest.raises(NotImplementedError, match=r"swiglu .*\bup\b"):
        torch.func.jvp(lambda u: lt.swiglu(g, u), (g,), (torch.ones_like(g),))


@pytest.mark.parametrize("call, exc, message", [
    (lambda m, x: lt.tiled_mlp(m, x, num_shards=0), ValueError, "num_shards"),
    (lambda m, x: lt.tiled_mlp(m, x[0, 0]), ValueError, r"\[\.\.\., T, H\]"),
    (lambda m, x: lt.tiled_mlp(m.forward, x), TypeError, "mlp must be a torch.nn.Module"),
    (lambda m, x: lt.tiled_mlp(m, x.long()), TypeError, "x must be a floating"),
    (lambda m, x: lt.tiled_mlp(m, x, grad_accum_dtype=torch.bfloat16), ValueError,
     "grad_accum_dtype"),
    (lambda m, x: lt.TiledMLP(m, num_shards=-2), ValueError, "num_shards"),
    (lambda m, x: lt.tiled_mlp(_SumOverTokens(), x), ValueError, "position-wise"),
    (lambda m, x: lt.SwiGLUMLP(16, 0), ValueError, "intermediate_size"),
])
def test_torch_bad_arguments(call, exc, message):
    m, x = _small(LlamaMLP)
    with pytest.raises(exc, match=message):
        call(m, x)


class _SumOverTokens(nn.Module):
    def forward(self, x):
        return x.sum(-2)


# ----------------------------------------------------------------------------- JAX
GENERIC_JAX_CASE = dataclasses.replace(CASES[0], bias=False)  # bias: see the torch generic test


@pytest.mark.parametrize("case, fused", [(CASES[0], True), (CASES[2], True), (CASES[4], True),
                                         (GENERIC_JAX_CASE, False)],
                         ids=lambda v: v.id if isinstance(v, Case) else ["generic", "fused"][v])
def test_jax_tiled_matches_float64(case, fused):
    """fused: ``lj.SwiGLUMLP`` (its written-out shard backward, the XLA SwiGLU; the Pallas one
    is in the parity test below), the tolerance scaled by the naive PyTorch MLP's error (no
    compile; the parity test takes the naive JAX path's too). generic: any fn (the naive jnp
    MLP, through jax.vjp), the tolerance scaled by that same fn's untiled error."""
    x, p, dy = make_inputs(case)
    if fused:
        fn = lj.SwiGLUMLP(case.shape[-1], case.i, bias=case.bias, backend="xla")
        naive = torch_run(case, x, p, dy, cls=LlamaMLP, tiled=False)
    else:
        fn = naive_jax_mlp
        naive = jax_run(case, x, p, dy, fn, tiled=False)
    compare(case.dtype, jax_run(case, x, p, dy, fn), reference(x, p, dy), naive)


def test_jax_jit_grad_vmap_of_any_fn_equal_untiled():
    """A plain jnp MLP (not ours) tiled with the default shard count, under jit, grad and
    vmap over a leading axis."""
    mlp = naive_jax_mlp
    params = jax_params(make_inputs(Case((21, 16), 40, bias=True))[1], "float32")
    x = jax.random.normal(jax.random.PRNGKey(SEED % 1000), (3, 2, 21, 16))
    loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
    tiled = lambda p, x: lj.tiled_mlp(mlp, p, x)  # ceil(21 / 16) = 2 shards
    # fp32 matmuls in fp32: on a GPU XLA's default precision rounds the operands TF32-like,
    # and the tiled and untiled sums then differ by ~1e-5 (1.3e-5 at one seed on an H200)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.grad(loss(mlp), argnums=(0, 1)))(params, x)
        # per-example gradients under vmap: their sum over the mapped axis is the batch one
        dp, dx = jax.jit(jax.vmap(jax.grad(loss(tiled), argnums=(0, 1)), in_axes=(None, 0)))(
            params, x)
    got = (jax.tree_util.tree_map(lambda g: g.sum(0), dp), dx)
    # fp32: the same values up to summation order (norm-wise; single elements may cancel)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert rel_err(a, b) <= FLOOR["float32"], rel_err(a, b)


def _mm(a, b):
    # full fp32: XLA's DEFAULT precision on a GPU rounds fp32 operands TF32-like, and tiled vs
    # untiled sums would then differ by ~2e-5, past the fp32 floor
    return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)


def test_jax_unhashable_and_closure_fns_are_not_confused():
    """The compiled tiled function is cached on ``fn``: an unhashable callable still works
    (uncached), and two closures of equal code but different captured values each get their
    own result (a closure is keyed by identity, never by its code)."""
    params = {"w": jax.random.normal(jax.random.PRNGKey(SEED + 1), (16, 16))}
    x = jax.random.normal(jax.random.PRNGKey(SEED + 2), (21, 16))

    @dataclasses.dataclass  # eq without frozen: __hash__ is None
    class Unhashable:
        scale: float

        def __call__(self, p, x):
            return jnp.tanh(_mm(x, p["w"])) * self.scale

    fns = [Unhashable(2.0)] + [(lambda s: lambda p, x: jnp.tanh(_mm(x, p["w"])) * s)(s)
                               for s in (2.0, 3.0)]
    for fn in fns:
        for _ in range(2):
            got = jax.grad(lambda p, x: jnp.sum(lj.tiled_mlp(fn, p, x, num_shards=3) ** 2),
                           argnums=(0, 1))(params, x)
            want = jax.grad(lambda p, x: jnp.sum(fn(p, x) ** 2), argnums=(0, 1))(params, x)
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                assert rel_err(a, b) <= FLOOR["float32"], rel_err(a, b)


def test_jax_fns_with_changing_state_or_traced_closures():
    """Only a SwiGLUMLP's tiled program is cached across calls: a callable whose attribute
    changes between calls is traced anew (a cache keyed by identity replayed the first call's
    value), and a closure over a value traced by an enclosing jit works (a cached program
    leaked that tracer)."""
    params = {"w": jax.random.normal(jax.random.PRNGKey(SEED + 3), (16, 16))}
    x = jax.random.normal(jax.random.PRNGKey(SEED + 4), (21, 16))

    class Scaled:  # hashable by identity, mutable
        scale = 1.0

        def __call__(self, p, x):
            return jnp.tanh(_mm(x, p["w"])) * self.scale

    fn = Scaled()
    first = lj.tiled_mlp(fn, params, x, num_shards=3)
    fn.scale = 3.0
    assert rel_err(lj.tiled_mlp(fn, params, x, num_shards=3), 3.0 * first) <= FLOOR["float32"]

    def loss(p, x, scale, tiled):
        f = lambda p, x: jnp.tanh(_mm(x, p["w"])) * scale  # scale is traced under jit
        return jnp.sum((lj.tiled_mlp(f, p, x, num_shards=3) if tiled else f(p, x)) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
    for scale in (2.0, 0.5):
        got, want = grad(params, x, scale, True), grad(params, x, scale, False)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert rel_err(a, b) <= FLOOR["float32"], rel_err(a, b)


def test_jax_closed_over_arrays_get_gradients():
    """``fn`` closing over the arrays being differentiated (a Flax NNX module called as
    ``lambda _, x: module(x)`` under ``nnx.grad`` does this): their gradients equal the
    untiled function's, with a ragged last shard, under jit and with params too (closed over,
    the custom VJP had leaked a tracer: UnexpectedTracerError)."""
    k = jax.random.split(jax.random.PRNGKey(SEED + 5), 4)
    w1, w2 = jax.random.normal(k[0], (16, 24)), jax.random.normal(k[1], (24, 16)) / 5
    params = {"b": jax.random.normal(k[2], (16,))}
    x = jax.random.normal(k[3], (2, 11, 16))  # 22 tokens in shards of 8, 8, 6

    def loss(w1, w2, p, x, tiled):
        f = lambda p, xs: _mm(jnp.tanh(_mm(xs, w1)), w2) + p["b"]
        return jnp.sum(jnp.sin(lj.tiled_mlp(f, p, x, num_shards=3) if tiled else f(p, x)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)
    got, want = grad(w1, w2, params, x, True), grad(w1, w2, params, x, False)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert rel_err(a, b) <= FLOOR["float32"], rel_err(a, b)


_F64_BIAS_PROBE = """
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np, jax.numpy as jnp
import logitless.jax as lj
mlp = lj.SwiGLUMLP(8, 12, bias=True)
p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), mlp.init(jax.random.PRNGKey(0)))
x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 8), jnp.float64)
f64 = lambda a: np.asarray(a, np.float64)
ref = lambda d, a: f64(a) @ f64(d["kernel"]) + f64(d["bias"])
h = ref(p["gate_proj"], x)
want = ref(p["down_proj"], h / (1 + np.exp(-h)) * ref(p["up_proj"], x))
for y in (mlp(p, x), lj.tiled_mlp(mlp, p, x, num_shards=3)):
    assert y.dtype == jnp.float64, y.dtype
    err = np.abs(f64(y) - want).max() / np.abs(want).max()
    assert err < 1e-13, err
"""


def test_jax_swiglu_mlp_with_bias_computes_float64_in_float64():
    """(x64 is process-wide in JAX: a subprocess.) The bias path summed in float32."""
    r = subprocess.run([sys.executable, "-c", _F64_BIAS_PROBE], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("num_shards", [2, 4])  # 2: one shard after the first, no loop
def test_jax_fused_path_and_accumulator_dtype(monkeypatch, num_shards):
    """Traced, not compiled: the written-out SwiGLU backward runs for a plain SwiGLUMLP only
    (not a subclass, which may override __call__), and its weight gradients are accumulated
    in fp32 (f32[H, I] values in the program) only with grad_accum_dtype=jnp.float32 (the
    default, None, sums in the parameters' dtype)."""
    from logitless import tiled_mlp_jax as tmj
    calls = []
    real = tmj._swiglu_shard_grads
    monkeypatch.setattr(tmj, "_swiglu_shard_grads", lambda *a: calls.append(1) or real(*a))

    class Sub(lj.SwiGLUMLP):
        pass

    x = jnp.ones((64, 8), jnp.bfloat16)
    for mlp, accum, fused in ((lj.SwiGLUMLP(8, 24), jnp.float32, True),
                              (lj.SwiGLUMLP(8, 24), None, True), (Sub(8, 24), jnp.float32, False)):
        calls.clear()
        params = mlp.init(jax.random.PRNGKey(0), jnp.bfloat16)
        loss = lambda p: jnp.sum(lj.tiled_mlp(mlp, p, x, num_shards=num_shards,
                                              grad_accum_dtype=accum))
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
        if accum is None:  # the default is the same program
            default = lambda p: jnp.sum(lj.tiled_mlp(mlp, p, x, num_shards=num_shards))
            assert str(jax.make_jaxpr(jax.grad(default))(params)) == jaxpr
        assert bool(calls) == fused, type(mlp)
        # [shard, I] intermediates are [64 / num_shards, 24]; the accumulators [H, I] = [8, 24]
        assert ("f32[8,24]" in jaxpr) == (accum is not None), (type(mlp), accum)
        assert all(g.dtype == jnp.bfloat16 for g in
                   jax.tree_util.tree_leaves(jax.eval_shape(jax.grad(loss), params)))


def _temp_bytes(t, tiled, *, h=32, i=512, shard=64):
    mlp = lj.SwiGLUMLP(h, i, backend="xla")
    params = jax.eval_shape(mlp.init, jax.random.PRNGKey(0))
    x = jax.ShapeDtypeStruct((t, h), jnp.float32)

    def loss(p, x):
        y = lj.tiled_mlp(mlp, p, x, num_shards=t // shard) if tiled else mlp(p, x)
        return jnp.sum(y * y)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_jax_temp_memory_is_one_shards():
    """XLA's compiled temp memory of jit(grad) grows with T·H (the output and dx buffers),
    not with T·I: the [shard, I] intermediates exist once. The untiled MLP's grows ~T·I."""
    h, i = 32, 512
    small, big = _temp_bytes(256, True), _temp_bytes(2048, True)
    untiled = _temp_bytes(2048, False)
    growth = big - small
    assert growth <= 3 * (2048 - 256) * h * 4, (small, big)
    assert growth < 0.1 * (2048 - 256) * i * 4, (small, big)
    assert big < untiled / 4, (big, untiled)


def test_jax_bad_arguments():
    mlp = lj.SwiGLUMLP(16, 32)
    p = mlp.init(jax.random.PRNGKey(0))
    x = jnp.ones((10, 16))
    with pytest.raises(ValueError, match="num_shards"):
        lj.tiled_mlp(mlp, p, x, num_shards=0)
    with pytest.raises(TypeError, match="x must be a floating"):
        lj.tiled_mlp(mlp, p, x.astype(jnp.int32))
    with pytest.raises(ValueError, match="position-wise"):
        lj.tiled_mlp(lambda p, x: x.sum(-2), p, x)
    with pytest.raises(TypeError, match=r"params\['n'\] must be a floating"):
        lj.tiled_mlp(lambda p, x: x, {"n": jnp.int32(3)}, x)
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        lj.tiled_mlp(mlp, p, x, grad_accum_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="hidden_size"):
        lj.SwiGLUMLP(0, 4)


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("case", CASES[:1], ids=lambda c: c.id)
def test_torch_and_jax_agree(case):
    """The same inputs through PyTorch (fused tiled path) and JAX (tiled, Pallas SwiGLU): each
    agrees with float64, and they agree with each other within the looser of the two naive
    paths' tolerances."""
    x, p, dy = make_inputs(case, salt=9)
    ref = reference(x, p, dy)
    naive = [torch_run(case, x, p, dy, cls=LlamaMLP, tiled=False),
             jax_run(case, x, p, dy, naive_jax_mlp, tiled=False)]
    a = torch_run(case, x, p, dy)
    b = jax_run(case, x, p, dy, lj.SwiGLUMLP(case.shape[-1], case.i, bias=case.bias,
                                             backend="pallas"))
    for key, r in ref.items():
        tol = max(max(FACTOR * rel_err(nv[key], r) for nv in naive), FLOOR[case.dtype])
        assert rel_err(a[key], r) <= tol and rel_err(b[key], r) <= tol, key
        assert rel_err(a[key], b[key]) <= tol, f"{key}: torch vs jax {rel_err(a[key], b[key]):.3g}"


# ----------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("accum", [torch.float32, None])
def test_gpu_llama_like_shape_and_no_host_sync(accum):
    torch.manual_seed(SEED)
    h, i, t = 1024, 2816, 4096
    m = lt.SwiGLUMLP(h, i, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16)
    ref = LlamaMLP(h, i, dtype=torch.float64).cuda()
    naive = LlamaMLP(h, i, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for a, b in zip(ref.parameters(), m.parameters()):
            a.copy_(b)
        for a, b in zip(naive.parameters(), m.parameters()):
            a.copy_(b)
    x64 = x.detach().double().requires_grad_()
    ref(x64).backward(dy.double())
    xn = x.detach().clone().requires_grad_()
    naive(xn).backward(dy)
    lt.tiled_mlp(m, x, num_shards=4, grad_accum_dtype=accum).backward(dy)  # compiles kernels
    x.grad = None
    m.zero_grad(set_to_none=True)
    with no_host_sync():
        y = lt.tiled_mlp(m, x, num_shards=4, grad_accum_dtype=accum)
        y.backward(dy)
    e = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    assert e(x.grad, x64.grad) <= max(FACTOR * e(xn.grad, x64.grad), FLOOR["bfloat16"])
    for (n, p), r, nv in zip(m.named_parameters(), ref.parameters(), naive.parameters()):
        assert e(p.grad, r.grad) <= max(FACTOR * e(nv.grad, r.grad), FLOOR["bfloat16"]), n


@gpu
@pytest.mark.parametrize("accum", [torch.float32, None])
def test_gpu_fused_path_memory_is_what_the_docstring_says(accum):
    """Peak over what was held before a fwd+bwd (y kept, as a caller holding it would): the
    output y, dx, the weight-gradient accumulators (fp32, or the bf16 gradients themselves)
    and 2.5 [shard, I] buffers, plus 5% and 3 MiB for the allocator. Nothing else: no
    per-shard gradient temporaries, no shard buffer alive while the accumulators are cast."""
    torch.manual_seed(SEED)
    h, i, t, shards = 1024, 2816, 4096, 4
    m = lt.SwiGLUMLP(h, i, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = None
        m.zero_grad(set_to_none=True)
        y = lt.tiled_mlp(m, x, num_shards=shards, grad_accum_dtype=accum)
        y.backward(dy)
        return y

    step()  # cuBLAS workspaces, kernels
    x.grad = None
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    n_params = sum(p.numel() for p in m.parameters())
    acc = n_params * (4 if accum is not None else 2)
    scratch = 2.5 * (t // shards) * i * 2
    # + 3 MiB: what the process's history leaves to chance (a cached block up to 1 MiB larger
    # than asked for counts whole; library workspaces). Measured on an H100: up to 1.7 MB over
    # 5%, depending on which tests ran before. Each per-shard temporary this test guards
    # against would be 5.8 MB or more.
    assert peak <= 1.05 * (2 * y.numel() * 2 + acc + scratch) + (3 << 20), peak


@gpu
def test_gpu_inductor_compile():
    m, x = _small(dtype=torch.bfloat16, seed=9)
    wrapper = lt.TiledMLP(m, num_shards=3)
    want = _grads(m, x, wrapper)
    got = _grads(m, x, torch.compile(wrapper, fullgraph=True))
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs JAX on a GPU")
@pytest.mark.parametrize("shards", [4, None], ids=["tiled", "untiled"])
def test_jax_gpu_swiglu_backward_overwrites_gate_and_up_without_copies(shards):
    """The Pallas SwiGLU backward writes dg, du over gate and up. In the tiled MLP's written-out
    backward XLA copied both first (two more [shard, I] buffers: temp 537 MB instead of 453 at
    the TARGETS shape, ~2 ms) while nothing ordered the forward kernel's reads of them before
    it (H100: fails without the barrier). Untiled, through lj.swiglu's custom VJP, XLA copies
    neither (checked the same way without any barrier): kept as a guard. No [tokens, I] copy in
    the compiled program."""
    h, i, t = 512, 1792, 4096
    mlp = lj.SwiGLUMLP(h, i, backend="pallas")
    params = jax.eval_shape(lambda k: mlp.init(k, jnp.bfloat16), jax.random.PRNGKey(0))
    x = jax.ShapeDtypeStruct((t, h), jnp.bfloat16)
    fn = mlp if shards is None else lambda p, x: lj.tiled_mlp(mlp, p, x, num_shards=shards)

    def fwd_bwd(p, x, dy):
        y, vjp = jax.vjp(fn, p, x)
        return (y,) + vjp(dy)

    hlo = jax.jit(fwd_bwd).lower(params, x, x).compile().as_text()
    shard_shape = f"bf16[{t // (shards or 1)},{i}]"
    assert "logitless_swiglu_bwd" in hlo  # the Pallas backward kernel is in the program
    copies = [line.strip()[:160] for line in hlo.splitlines()
              if " copy(" in line and f"= {shard_shape}" in line]
    assert not copies, copies
