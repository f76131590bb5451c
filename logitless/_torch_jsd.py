"""Linear JSD on the PyTorch side: argument checks and flattening, the backend table, the
public function and its ``nn.Module`` (re-exported by :mod:`logitless.torch`), and the pieces
every torch backend of the op shares (fp32 logits GEMMs, the "mean" divisor).

See :mod:`logitless.specs.linear_jsd` for the math.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

import torch

from . import _torch_common as common
from .specs import linear_jsd as spec

__all__ = ["linear_jsd", "LinearJSDLoss", "available_backends"]

# backend name -> module implementing ``linear_jsd(prepared, opts, **tuning)`` and listing its
# tuning keywords in ``TUNING``. "pallas" imports JAX and stays lazy.
_BACKENDS = {
    "torch": "logitless.torch_jsd",
    "triton": "logitless.triton_kernels.linear_jsd",
    "pallas": "logitless.bridge.linear_jsd",
}
_LOADED = {}


def _load(name: str):
    mod = _LOADED.get(name)  # a dict lookup on the hot path: torch.compile traces it
    if mod is None:
        mod = _LOADED[name] = importlib.import_module(_BACKENDS[name])
    return mod


def available_backends(device="cpu"):
    """Backends that can run on ``device`` (``None`` picks the first of these)."""
    device = torch.device(device)
    return (["triton"] if (device.type == "cuda" and "triton" in _LOADED) else []) + ["torch", "pallas"]


def _resolve(backend: Optional[str], device: torch.device, dtype: torch.dtype):
    if backend is None:  # Triton on CUDA for the dtypes it has kernels for (not float64)
        backend = ("triton" if (device.type == "cuda" and "triton" in _LOADED and
                                dtype != torch.float64) else "torch")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {sorted(_BACKENDS)}, got {backend!r}")
    return backend, _load(backend)


# ------------------------------------------------------------------------------ arguments
@dataclasses.dataclass
class Prepared:
    xs: torch.Tensor            # (N, H_s) student hidden states
    ws: torch.Tensor            # (V, H_s) student head (may be non-contiguous)
    xt: torch.Tensor            # (N, H_t) teacher hidden states (detached)
    wt: torch.Tensor            # (V, H_t) teacher head (detached)
    y: Optional[torch.Tensor]   # (N,) integer targets, or None
    problem: spec.Problem


def prepare(student_input, student_weight, teacher_input, teacher_weight, target,
            opts: spec.LinearJSDOptions) -> Prepared:
    """Check types, dtypes, devices and shapes (errors name the argument); flatten to 2-D.
    The teacher tensors are detached: the teacher gets no gradient."""
    args = (("student_input", student_input), ("student_weight", student_weight),
            ("teacher_input", teacher_input), ("teacher_weight", teacher_weight))
    for name, t in args + (("target", target),):
        if t is None and name == "target":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in args:
        if t.dtype not in common.FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (float32/bfloat16/float16/float64), "
                            f"got {t.dtype}")
    if student_weight.dtype != student_input.dtype:
        raise TypeError(f"student_weight dtype {student_weight.dtype} does not match "
                        f"student_input dtype {student_input.dtype}")
    if teacher_weight.dtype != teacher_input.dtype:
        raise TypeError(f"teacher_weight dtype {teacher_weight.dtype} does not match "
                        f"teacher_input dtype {teacher_input.dtype}")
    if target is not None and (target.dtype == torch.bool or target.is_floating_point()
                               or target.is_complex()):
        raise TypeError(f"target must hold integer class indices (e.g. torch.long), got {target.dtype}")
    dev = student_input.device
    for name, t in args[1:] + (("target", target),):
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but student_input is on {dev}; "
                             "move them to one device")
    problem = spec.check_shapes(student_input.shape, student_weight.shape, teacher_input.shape,
                                teacher_weight.shape, None if target is None else target.shape,
                                options=opts)
    n = problem.n
    return Prepared(xs=student_input.reshape(n, problem.h_s), ws=student_weight,
                    xt=teacher_input.detach().reshape(n, problem.h_t), wt=teacher_weight.detach(),
                    y=None if target is None else target.reshape(n).contiguous(),  # read with stride 1
                    problem=problem)


# ------------------------------------------------------------------------ shared by backends
def logits_f32(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None):
    """``x @ w.T`` with a float32 result (float64 for float64 inputs), never rounded to the
    input dtype: on CUDA the half-precision GEMM writes fp32 directly (tensor cores, fp32
    accumulation); elsewhere the operands are upcast. JSD needs this precision (spec)."""
    if x.dtype in (torch.float32, torch.float64):
        return torch.mm(x, w.t(), out=out)
    if x.is_cuda:
        return torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
    return torch.mm(x.float(), w.float().t(), out=out)


def token_count(y: Optional[torch.Tensor], n: int, ignore_index: int, like: torch.Tensor):
    """Σ_i m_i as a 0-d float32 tensor on ``like``'s device (no host sync)."""
    if y is None:
        return torch.full((), float(n), dtype=torch.float32, device=like.device)
    return (y != ignore_index).sum(dtype=torch.float32)


def mean_denominator(y, n, ignore_index, like):
    """Σm, or 1 where Σm = 0 (an all-ignored batch gives loss 0 and zero gradients)."""
    return common.mean_denominator(token_count(y, n, ignore_index, like))


# ------------------------------------------------------------------------------ front door
def linear_jsd(student_input, student_weight, teacher_input, teacher_weight, target=None, *,
               beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean",
               hard_loss_weight=0.0, backend=None, **tuning):
    """Generalized Jensen-Shannon divergence between a student and a teacher LM head,
    without materializing either ``[N, V]`` logits tensor (Liger-compatible semantics).

    Per token: Q = softmax(student_input @ student_weightᵀ / T), P = softmax(teacher_input @
    teacher_weightᵀ / T), M = β·P + (1−β)·Q and the loss β·KL(P‖M) + (1−β)·KL(Q‖M); β = 0 is
    KL(P‖Q) and β = 1 is KL(Q‖P) (defined as such: the general formula is 0 there). No T²
    factor. See :mod:`logitless.specs.linear_jsd`.

    Args:
        student_input: ``(..., H_s)`` student hidden states (float32, bfloat16 or float16;
            float64 on ``backend="torch"``).
        student_weight: ``(V, H_s)`` student head, same dtype as ``student_input``; may be
            non-contiguous (e.g. a transposed tied embedding).
        teacher_input: ``(..., H_t)`` teacher hidden states (same leading shape; ``H_t`` may
            differ from ``H_s``).
        teacher_weight: ``(V, H_t)`` teacher head, same dtype as ``teacher_input``.
            The teacher gets no gradient (its tensors are treated as constants).
        target: optional ``(...)`` integer labels: tokens equal to ``ignore_index`` contribute
            neither loss nor gradient; required when ``hard_loss_weight > 0``.
        beta: in ``[0, 1]``.
        temperature: ``T > 0``, divides both heads' logits.
        ignore_index: label value of skipped tokens.
        reduction: ``"mean"`` (over non-ignored tokens; 0 when all are ignored), ``"sum"`` or
            ``"none"`` (per-token losses shaped like the leading dims).
        hard_loss_weight: ``w_h >= 0``: adds ``w_h·cross_entropy(student logits, target)``
            per token (raw logits, no temperature), as distillation recipes mix both.
        backend: ``None`` (Triton on CUDA, except float64; else ``"torch"``), ``"triton"``, ``"torch"``
            (chunked plain PyTorch) or ``"pallas"`` (the JAX/Pallas port through DLPack).
        **tuning: chunk and block sizes of the chosen backend as keywords (e.g.
            ``chunk_size``, ``memory_budget``); unknown keywords are an error.

    Under ``torch.autocast`` the four hidden-state / head tensors are cast to the autocast
    dtype first, as ``F.linear`` would cast them.

    Returns:
        The loss (float32; float64 for float64 inputs): a scalar, or per-token for "none".
    """
    opts = spec.LinearJSDOptions(
        beta=beta, temperature=temperature, reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index,
        hard_loss_weight=hard_loss_weight)
    student_input, student_weight, teacher_input, teacher_weight = common.autocast_inputs(
        student_input, student_weight, teacher_input, teacher_weight)
    prepared = prepare(student_input, student_weight, teacher_input, teacher_weight, target, opts)
    name, impl = _resolve(backend, prepared.xs.device, prepared.xs.dtype)
    unknown = sorted(set(tuning) - set(impl.TUNING))
    if unknown:
        raise TypeError(f"unknown tuning keyword(s) {unknown} for backend={name!r}; "
                        f"it accepts {list(impl.TUNING)}")
    if prepared.y is not None:
        common.check_targets(prepared.y, prepared.problem.v, opts.ignore_index)
    with common.autocast_off(prepared.xs.device):
        loss = impl.linear_jsd(prepared, opts, **tuning)
    if opts.reduction == "none":
        loss = loss.reshape(prepared.problem.batch_shape)
    return loss


class LinearJSDLoss(torch.nn.Module):
    """Module form of :func:`linear_jsd`: options at construction,
    ``forward(student_input, student_weight, teacher_input, teacher_weight, target=None)``."""

    def __init__(self, *, beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean",
                 hard_loss_weight=0.0, backend=None, **tuning):
        super().__init__()
        self.options = spec.LinearJSDOptions(
            beta=beta, temperature=temperature, reduction=reduction,
            ignore_index=-100 if ignore_index is None else ignore_index,
            hard_loss_weight=hard_loss_weight)
        self.backend = backend
        self.tuning = dict(tuning)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, target=None):
        o = self.options
        return linear_jsd(student_input, student_weight, teacher_input, teacher_weight, target,
                          beta=o.beta, temperature=o.temperature, ignore_index=o.ignore_index,
                          reduction=o.reduction, hard_loss_weight=o.hard_loss_weight,
                          backend=self.backend, **self.tuning)

    def extra_repr(self):
        return f"{self.options}, backend={self.backend!r}"


# Load the cheap backends now so that a first call under torch.compile needs no import.
_load("torch")
try:
    import triton  # noqa: F401
    _load("triton")
except ImportError:
    pass
