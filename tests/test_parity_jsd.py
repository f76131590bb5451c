"""Cross-framework parity for linear JSD: the very same random inputs through the PyTorch
backends (torch, triton, pallas through the bridge) and the JAX backends (xla, pallas).

* every backend agrees with the float64 spec (the harness tolerance) on one shared input set;
* PyTorch-side and JAX-side implementations of the same algorithm agree with each other to
  that tolerance plus the output roundings (``harness.pair_tolerance``; torch <-> xla,
  triton <-> pallas);
* the bridge changes nothing: PyTorch -> JAX through the bridge gives what the same JAX backend
  gives when called from JAX, within a few ulps of the output dtype.
"""
from __future__ import annotations

import numpy as np
import pytest

import backends  # noqa: F401  (registers the backends)
from backends_jsd_jax import jsd_runner as jax_runner, pallas_test_tuning
from backends_jsd_torch import torch_collect, torch_inputs
from harness import backends as registry, confirmed, every_backend_agrees, ulp
from helpers import pick_cases
from op_linear_jsd import OP

BACKENDS = registry(OP.name)
PYTORCH_SIDE = ("torch", "triton", "bridge-pallas")
JAX_SIDE = ("xla", "pallas")
PAIRS = (("torch", "xla"), ("triton", "pallas"))
BRIDGE_ULPS = 2  # see test_parity.py: the fused path's dX rounding between two programs
GRAD_KEYS = ("dx", "dw")


def _pick():
    cases = OP.cases()
    want = {
        "f32-mean": lambda c: c.dtype == "float32" and c.reduction == "mean" and c.beta == 0.5
        and c.n == 37 and c.targets and c.ignore == "some" and c.correlated and
        c.temperature == 1 and not c.hard_loss_weight and not c.teacher_dtype,
        "bf16-none": lambda c: c.dtype == "bfloat16" and c.reduction == "none" and c.n == 37
        and c.targets and c.ignore == "some" and not c.hard_loss_weight,
        "f16-sum-hard": lambda c: c.dtype == "float16" and c.reduction == "sum" and
        c.hard_loss_weight and c.n == 37,
        "hard-T": lambda c: c.hard_loss_weight and c.temperature != 1 and c.n == 37,
        "reverse-kl-n1": lambda c: c.n == 1 and c.beta == 1.0,
        "all-ignored": lambda c: c.ignore == "all" and c.reduction == "mean" and
        c.dtype == "float32",
    }
    return pick_cases(cases, want)


PICKED = _pick()
BRIDGE_CASES = [PICKED[k] for k in ("f32-mean", "bf16-none", "hard-T")]


@pytest.mark.parametrize("case", [PICKED[k] for k in ("f32-mean", "bf16-none", "f16-sum-hard",
                                                      "reverse-kl-n1", "all-ignored")],
                         ids=lambda c: c.id)
def test_same_inputs_every_backend(case):
    confirmed(lambda salt: every_backend_agrees(OP, case, PYTORCH_SIDE + JAX_SIDE, PAIRS, salt),
              salt=7)


def _bridge_runner(jax_backend, **tuning):
    """PyTorch tensors -> the bridge -> any JAX backend, options as the JAX runner passes them."""
    def run(case, inp):
        import logitless._torch_jsd as jc
        from logitless.bridge.linear_jsd import bridged
        xs, ws, xt, wt, y, g = torch_inputs(case, inp)
        opts = case.options()
        kw = dict(tuning)
        if case.chunk_size:
            kw["chunk_size"] = case.chunk_size
        loss = bridged(jc.prepare(xs, ws, xt, wt, y, opts), opts, jax_backend, kw)
        return torch_collect(loss, xs, ws, xt, wt, g)
    return run


@pytest.mark.parametrize("case", BRIDGE_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("jax_backend", ["xla", "pallas"])
def test_bridge_matches_jax_called_from_jax(case, jax_backend):
    inp = OP.make_inputs(case, 11)
    tuning = pallas_test_tuning() if jax_backend == "pallas" else {}
    native = jax_runner(jax_backend, **tuning)(case, inp)
    bridged = _bridge_runner(jax_backend, **tuning)(case, inp)
    for key in OP.reference(case, inp):
        a, b = np.asarray(bridged[key]), np.asarray(native[key])
        assert a.shape == b.shape and np.isfinite(a).all(), key
        u = ulp(b, case.dtype if key in GRAD_KEYS else "float32")
        worst = float(np.max(np.abs(a - b) / u)) if a.size else 0.0
        assert worst <= BRIDGE_ULPS, f"{key}: bridge vs {jax_backend} differ by {worst:.3g} ulps"
