"""Linear JSD on the PyTorch side: argument checks and flattening, the backend table, the
public function and its ``nn.Module`` (re-exported by :mod:`logitless.torch`), and the pieces
every torch backend of the op shares (fp32 logits GEMMs, the "mean" divisor).

See :mod:`logitless.specs.linear_jsd` for the math.
"""
from __future__ import annotations

import dataclasses
import inspect
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
# what a keyword of logitless.jax or of linear_cross_entropy's vocab parallelism is here
_KEYWORD_HINTS = {**common.JAX_WEIGHT_LAYOUT, **common.JSD_NOT_VOCAB_PARALLEL}


def _load(name: str):
    return common.load_backend(_LOADED, _BACKENDS, name)


def available_backends(device="cpu"):
    """Backends that can run on ``device`` (``None`` picks the first of these)."""
    return common.available_backends(torch.device(device), _LOADED)


def _triton_usable(device: torch.device) -> bool:
    return common.triton_usable(device, _LOADED)


def _resolve(backend: Optional[str], device: torch.device, dtype: torch.dtype):
    if backend is None:  # Triton on CUDA for the dtypes it has kernels for (not float64)
        backend = "triton" if (_triton_usable(device) and dtype != torch.float64) else "torch"
    _check_backend(backend)
    return backend, _load(backend)


def _check_backend(backend):
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {sorted(_BACKENDS)}, got {backend!r}")


# The Triton backend's tuning keywords where Triton is not installed (see logitless.torch's
# _TRITON_TUNING); tests/test_torch_errors.py checks it against the module's TUNING.
_TRITON_TUNING = ("chunk_size", "logits_chunk_size", "memory_budget", "fp32_logits",
                  "grad_accum_dtype", "block_v", "segment_size", "num_warps", "programs_per_sm",
                  "row_sync", "dx_chunk_size", "fp16_tile_logits", "fp16_dz")


def _tuning_names(backend: Optional[str]):
    if backend is not None:
        _check_backend(backend)
    return common.tuning_names(backend, _LOADED, _load, _TRITON_TUNING)


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
    if target is not None:
        target = common.widen_targets(target, opts.ignore_index)
    common.refuse_forward_ad("linear_jsd", *args)
    dev = student_input.device
    for name, t in args[1:] + (("target", target),):
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but student_input is on {dev}; "
                             "move them to one device")
    problem = spec.check_shapes(student_input.shape, student_weight.shape, teacher_input.shape,
                                teacher_weight.shape, None if target is None else target.shape,
                                options=opts)
    n = problem.n
    xt, wt = teacher_input.detach(), teacher_weight.detach()
    # A teacher run under torch.inference_mode() hands over inference tensors, which autograd
    # refuses to save for backward: they are copied then (the plain KL recipe accepts them; a
    # teacher run under torch.no_grad() costs no copy). Compiled graphs take them as they are,
    # and dynamo cannot trace is_inference().
    if (not torch.compiler.is_compiling() and torch.is_grad_enabled()
            and (student_input.requires_grad or student_weight.requires_grad)):
        xt = xt.clone() if xt.is_inference() else xt
        wt = wt.clone() if wt.is_inference() else wt
    return Prepared(xs=student_input.reshape(n, problem.h_s), ws=student_weight,
                    xt=xt.reshape(n, problem.h_t), wt=wt,
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
        temperature: ``T > 0``, divides both heads' logits (not those of the hard-label term).
            The loss is *not* multiplied by T² (Liger's convention), so its gradient shrinks
            about as 1/T²: the usual ``α·T²·KL(P‖Q) + (1−α)·CE`` is
            ``α·T**2 * linear_jsd(..., beta=0.0, temperature=T,
            hard_loss_weight=(1−α)/(α·T**2))``.
        ignore_index: label value of skipped tokens.
        reduction: ``"mean"`` (over non-ignored tokens; 0 when all are ignored), ``"sum"`` or
            ``"none"`` (per-token losses shaped like the leading dims).
        hard_loss_weight: ``w_h >= 0``: adds ``w_h·cross_entropy(student logits, target)``
            per token (raw logits, no temperature), as distillation recipes mix both.
        backend: ``None`` (Triton on CUDA, except float64; else ``"torch"``), ``"triton"``, ``"torch"``
            (chunked plain PyTorch) or ``"pallas"`` (the JAX/Pallas port through DLPack).
        **tuning: the chosen backend's chunk sizes and options as keywords (listed below).
            A keyword no backend takes is a TypeError. With ``backend=None``, one of the
            backend *not* picked is dropped with a warning; with a named backend it is a
            TypeError.

    Tuning keywords (defaults in parentheses; ``None`` means derived from the budget or
    the shapes):

    * ``backend="torch"`` (:func:`logitless.torch_jsd.linear_jsd`): ``chunk_size`` (None:
      from ``memory_budget``), tokens per chunk; ``memory_budget`` (None: 1 GiB), bytes for
      one chunk's fp32 temporaries.
    * ``backend="triton"`` (:func:`logitless.triton_kernels.linear_jsd.linear_jsd`, whose
      docstring details them): ``chunk_size`` (None: from ``memory_budget``);
      ``logits_chunk_size`` (None: ``chunk_size / 4`` rounded down to a multiple of 128);
      ``memory_budget`` (None: 896 MiB); ``fp32_logits`` (True);
      ``grad_accum_dtype`` (``torch.float32``, or the input dtype);
      ``block_v`` (None: 1024 on a GPU); ``segment_size`` (None: 8192 on a GPU);
      ``num_warps`` (None: 4); ``programs_per_sm`` (None: 2);
      ``row_sync`` (None: one launch per pass); ``dx_chunk_size`` (None: on a GPU with
      H >= 4096, the rows one wave of 256 x 128 output tiles covers; else whole chunks),
      rows per dX GEMM call; ``fp16_tile_logits`` (False; True: logits stored in fp16
      relative to per-tile maxima, from our TMA GEMM, for bf16/fp16 inputs on a Hopper GPU,
      an error elsewhere; None: True where it can run): 0.93x the time, the loss ~1e-5 less
      accurate, nearly agreeing heads' gradients 1e-2 off.
      ``fp16_dz`` (None: True where it can run: bf16 student, "mean"/"sum", fp32 dW
      accumulation, β < 1, a Hopper GPU; True: an error where it cannot; False): the
      student's logit gradient in fp16 under a power-of-two scale, its dX/dW GEMMs ours
      (Gluon), the gradients ~1.67e-3 off instead of bf16 dz's ~2.2e-3.
    * ``backend="pallas"``: the keywords of :func:`logitless.jax.linear_jsd`'s ``"pallas"``
      backend (``logitless.pallas_kernels.linear_jsd.TUNING``).

    Under ``torch.autocast`` the four hidden-state / head tensors are cast to the autocast
    dtype first, as ``F.linear`` would cast them.

    Forward-mode AD (``torch.func.jvp``, ``jacfwd``) is refused (NotImplementedError);
    ``torch.func.vmap`` of the forward works (per sample) on "triton" and "torch"; "pallas"
    refuses any ``torch.func`` transform (NotImplementedError).

    Returns:
        The loss (float32; float64 for float64 inputs): a scalar, or per-token for "none".
    """
    opts = spec.LinearJSDOptions(
        beta=beta, temperature=temperature, reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index,
        hard_loss_weight=hard_loss_weight)
    if tuning:
        common.check_keyword_names("linear_jsd", tuning, _PARAMETERS, _tuning_names(backend),
                                   _KEYWORD_HINTS)
    student_input, student_weight, teacher_input, teacher_weight = common.autocast_inputs(
        student_input, student_weight, teacher_input, teacher_weight)
    prepared = prepare(student_input, student_weight, teacher_input, teacher_weight, target, opts)
    # a float64 teacher beside a lower-precision student runs where float64 does
    wide = torch.float64 in (prepared.xs.dtype, prepared.xt.dtype)
    name, impl = _resolve(backend, prepared.xs.device,
                          torch.float64 if wide else prepared.xs.dtype)
    if tuning:
        tuning = common.tuning_for_backend("linear_jsd", name, impl.TUNING, tuning,
                                           explicit=backend is not None)
    if prepared.y is not None and not getattr(impl, "CHECKS_TARGETS", False):
        common.check_targets(prepared.y, prepared.problem.v, opts.ignore_index)
    with common.autocast_off(prepared.xs.device):
        loss = impl.linear_jsd(prepared, opts, **tuning)
    if opts.reduction == "none":
        loss = loss.reshape(prepared.problem.batch_shape)
    return loss


_PARAMETERS = tuple(p for p in inspect.signature(linear_jsd).parameters if p != "tuning")


class LinearJSDLoss(torch.nn.Module):
    """Module form of :func:`linear_jsd`: options at construction,
    ``forward(student_input, student_weight, teacher_input, teacher_weight, target=None)``."""

    def __init__(self, *, beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean",
                 hard_loss_weight=0.0, backend=None, **tuning):
        super().__init__()
        if backend is not None:  # a misspelled backend fails here, not at the first forward
            _check_backend(backend)
        if tuning:  # misspelled or foreign keywords fail here, not at the first forward
            names, hints = common.module_keywords(
                LinearJSDLoss, ("student_input", "student_weight", "teacher_input",
                             "teacher_weight", "target"), _KEYWORD_HINTS)
            common.check_keyword_names(type(self).__name__, tuning, names,
                                       _tuning_names(backend), hints)
            if backend is not None:
                common.tuning_for_backend(type(self).__name__, backend, _load(backend).TUNING,
                                          tuning, explicit=True)
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
