"""Cross-framework parity: the very same random inputs through the PyTorch backends (torch,
triton), the JAX backends (xla, pallas) and the bridge (PyTorch -> JAX), for a handful of
cases covering every option.

* every backend agrees with the float64 spec (the harness tolerance: a small factor of the
  naive path's error in that dtype), checked on one shared set of inputs;
* PyTorch-side and JAX-side implementations of the same algorithm agree with each other to
  that same tolerance plus the output roundings (``harness.pair_tolerance``; torch <-> xla,
  triton <-> pallas);
* the bridge changes nothing: PyTorch -> JAX through the bridge gives what the same JAX
  backend gives when called from JAX, to within a few ulps of the output dtype.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import harness

import backends  # noqa: F401  (registers the backends)
from backends_jax import _pallas_test_tuning
from backends_torch import _torch_collect, _torch_inputs
from harness import backends
from helpers import pick_cases
from op_linear_cross_entropy import OP, cases_linear_cross_entropy, make_inputs, reference

BACKENDS = backends("linear_cross_entropy")

PYTORCH_SIDE = ("torch", "triton", "bridge-pallas")
JAX_SIDE = ("xla", "pallas")
PAIRS = (("torch", "xla"), ("triton", "pallas"))
# The bridge vs the same JAX backend called from JAX: at most this many ulps (of the output's
# dtype) apart, element by element. Mostly they are bitwise equal; but the fused mean/sum
# path keeps dX in the input dtype between its forward and backward, which the bridge runs as
# two programs, while JAX's single program may skip that rounding (XLA's excess precision).
BRIDGE_ULPS = 2
# ... and where single elements differ more (a GPU's different GEMM algorithms, below), the
# arrays' norm-wise difference in eps: two summation orders of K terms differ by ~√K·eps
# times the sum's cancellation, K up to 130 tokens here (2.29 eps seen on an H100 for dW
# with every option on; 2 had been the bound).
BRIDGE_NORM_EPS = 8
GRAD_KEYS = ("dx", "dw", "db")  # in the input dtype; loss and lse are float32


def _pick(cases):
    """A handful of the harness cases: every option, each reduction and dtype, N = 1, and an
    all-ignored batch (more would only repeat the per-backend suite)."""
    everything = lambda c: c.bias and c.class_weight and c.label_smoothing and c.z_loss and \
        c.softcap and c.lse_grad
    wanted = {
        "f32-mean-all": lambda c: c.dtype == "float32" and c.reduction == "mean" and everything(c)
        and c.n == 37,
        "bf16-none-all": lambda c: c.dtype == "bfloat16" and c.reduction == "none" and
        everything(c) and c.n == 37,
        "f16-sum-all": lambda c: c.dtype == "float16" and c.reduction == "sum" and everything(c),
        "n1": lambda c: c.n == 1 and c.dtype == "bfloat16",
        "all-ignored": lambda c: c.ignore == "all" and c.reduction == "mean" and
        c.dtype == "float32",
        "bf16-mean-plain": lambda c: c.dtype == "bfloat16" and c.reduction == "mean" and
        c.n == 37 and not (c.bias or c.class_weight or c.label_smoothing or c.z_loss or
                           c.softcap or c.lse_grad) and c.ignore == "some",
    }
    return pick_cases(cases, wanted, "the harness case matrix")


PICKED = _pick(cases_linear_cross_entropy())
CASES = [PICKED[k] for k in ("f32-mean-all", "bf16-none-all", "f16-sum-all", "n1", "all-ignored")]
# the bridge against the same JAX backend: the unfused (lse) path in each reduction kind, and
# the fused mean path (no lse)
BRIDGE_CASES = [PICKED[k] for k in ("f32-mean-all", "bf16-none-all", "bf16-mean-plain")]


def _bridge_runner(jax_backend, **tuning):
    """PyTorch tensors -> the bridge -> any JAX backend (the torch front door offers only
    pallas), with the options exactly as the JAX runner passes them."""
    def run(case, inp):
        from logitless import _torch_common as common
        from logitless.bridge.linear_cross_entropy import bridged
        x, w, b, y, cw, g, gl = _torch_inputs(case, inp)
        if case.chunk_size:
            tuning["chunk_size"] = case.chunk_size
        loss, lse = bridged(common.prepare(x, w, y, b, cw), case.options(), jax_backend, tuning)
        return _torch_collect(case, loss, lse, x, w, b, g, gl)
    return run


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_same_inputs_every_backend(case):
    harness.confirmed(lambda salt: harness.every_backend_agrees(
        OP, case, PYTORCH_SIDE + JAX_SIDE, PAIRS, salt), salt=7)


@pytest.mark.parametrize("case", BRIDGE_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("jax_backend", ["xla", "pallas"])
def test_bridge_matches_jax_called_from_jax(case, jax_backend):
    inp = make_inputs(case, salt=11)
    native = BACKENDS[jax_backend].run(case, inp)
    tuning = _pallas_test_tuning() if jax_backend == "pallas" else {}
    bridged = _bridge_runner(jax_backend, **tuning)(case, inp)
    for key in reference(case, inp):
        a, b = np.asarray(bridged[key]), np.asarray(native[key])
        assert a.shape == b.shape and np.isfinite(a).all(), key
        dtype = case.dtype if key in GRAD_KEYS else "float32"
        ulp = harness.ulp(b, dtype)
        worst = float(np.max(np.abs(a - b) / ulp)) if a.size else 0.0
        if worst <= BRIDGE_ULPS:
            continue
        # On a GPU, XLA compiles the bridge's two programs (forward, backward) and JAX's one
        # program with different GEMM algorithms / reduction orders, so single elements (the
        # small, cancellation-prone ones) can differ by more ulps; the arrays as a whole must
        # still agree to a few units of the format's precision.
        rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        unit = float(ml_dtypes.finfo(harness.NP_DTYPES[dtype]).eps)
        assert rel <= BRIDGE_NORM_EPS * unit, (
            f"{key}: bridge vs {jax_backend} differ by {worst:.3g} ulps (max), "
            f"{rel / unit:.3g} eps in norm")
