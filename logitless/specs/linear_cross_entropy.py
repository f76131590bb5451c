r"""Linear cross-entropy: the one definition every backend implements.

Inputs (after flattening the leading dims of ``input``/``target``):
``x (N, H)``, ``W (V, H)``, optional bias ``b (V,)``, targets ``y (N,)``, optional
class weights ``w (V,)`` (``w = 1`` without them), options ``ε`` (label_smoothing),
``ζ`` (z_loss), ``s`` (softcap), ``ignore_index``.

Forward, per token i (all arithmetic in fp32 or wider)::

    z_iv  = x_i · W_v + b_v                                 raw logits
    c_iv  = s·tanh(z_iv / s)       (c = z without softcap)  the logits the loss sees
    lse_i = log Σ_v exp(c_iv)
    m_i   = 0 if y_i == ignore_index else 1                 token mask
    ω_i   = m_i · w[y_i]                                    token weight
    Ω     = Σ_v w_v                                         (= V without class weights)
    ce_i  = (1-ε)·ω_i·(lse_i − c_{i,y_i}) + m_i·(ε/V)·Σ_v w_v·(lse_i − c_iv)
    l_i   = ce_i + ζ·ω_i·lse_i²

This is ``F.cross_entropy(c, y, weight=w, label_smoothing=ε, reduction="none")`` plus
the PaLM z-loss weighted like the token. Reductions::

    "none": l_i          "sum": Σ_i l_i          "mean": Σ_i l_i / Σ_i ω_i

and ``mean`` divides by 1 where Σω = 0, never giving NaN: a batch whose tokens are all ignored
has loss 0, and so has one whose targets all have class weight 0, unless label smoothing
adds its term (weighted by every w_v), which is then returned summed (``F.cross_entropy``
gives NaN there). ``lse``
(returned with ``return_lse``) is lse_i of the capped logits, also for ignored tokens.

Backward. Let g_i be the upstream gradient of token i's loss — ``g`` for "sum", ``g/Σω`` for
"mean" (``g`` when Σω = 0), ``g_i`` for "none" — and h_i the upstream gradient of lse_i
(0 unless ``return_lse`` is used in the graph). With p_iv = exp(c_iv − lse_i)::

    ∂l_i/∂c_iv = A_i·p_iv − B_i·[v = y_i] − m_i·(ε/V)·w_v
        A_i = (1-ε)·ω_i + m_i·(ε/V)·Ω + 2ζ·ω_i·lse_i
        B_i = (1-ε)·ω_i
    dc_iv = g_i·∂l_i/∂c_iv + h_i·p_iv
    dz_iv = dc_iv · (1 − (c_iv/s)²)        softcap chain rule (tanh' = 1 − tanh²); dz = dc without
    dX = dz · W        dW = dzᵀ · X        db = Σ_i dz_i

Ignored tokens have m = ω = 0, hence zero loss and zero gradient (unless lse is used), whatever
their loss's upstream gradient g_i: an inf or NaN there gives 0, not g_i·0 (as in
``F.cross_entropy``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence, Tuple

import numpy as np

REDUCTIONS = ("mean", "sum", "none")
FLOAT32_TINY, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyOptions:
    """The loss options, validated once here; backends read them, never re-check them."""

    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: Optional[float] = None
    return_lse: bool = False

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        check_ignore_index(self.ignore_index)
        object.__setattr__(self, "ignore_index", int(self.ignore_index))
        # plain Python floats: a NumPy float64 would promote fp32 math to float64 under JAX's
        # x64 mode, and equal options must hash equal (compile caches key on them)
        for name, lo, hi, lo_open in (("label_smoothing", 0.0, 1.0, False),
                                      ("z_loss", 0.0, None, False),
                                      ("softcap", 0.0, None, True)):
            if name != "softcap" or self.softcap is not None:
                object.__setattr__(self, name, _check_real(name, getattr(self, name), lo=lo,
                                                           hi=hi, lo_open=lo_open))
        if self.softcap is not None:
            check_float32_normal("softcap", self.softcap)
        if not isinstance(self.return_lse, (bool, np.bool_)):  # NumPy's too, as its numbers
            raise TypeError(f"return_lse must be a bool, got {self.return_lse!r}")
        object.__setattr__(self, "return_lse", bool(self.return_lse))

    @property
    def uses_smoothing(self) -> bool:
        return self.label_smoothing > 0.0


def not_static(name, value, what) -> TypeError:
    """The error for an option that is not a Python number, with a hint where it is a 0-d
    array or traced scalar (a jnp / torch scalar, or a value traced under ``jax.jit``): the
    options are compile-time constants of the kernels, and float32 would not keep them exact
    (β = 1 − 1e-7 needs float64)."""
    hint = ""
    if getattr(value, "shape", None) == ():
        conv = "int" if what == "an int" else "float"
        hint = ("; the options are compile-time constants of the kernels: pass a Python number "
                f"({conv}(t) of a 0-d tensor or array; under jax.jit close over the value or "
                "mark it static: each distinct value compiles once)")
    return TypeError(f"{name} must be {what}, got {value!r}{hint}")


def check_float32_normal(name: str, value: float) -> None:
    """A positive scale the kernels divide by in float32 (softcap, temperature): outside
    float32's normal range its reciprocal is not representable (z/value becomes 0 or inf,
    the gradients NaN). Values inside it can still overflow z/value for large logits (a
    temperature of 1e-37): the range is what the kernels need, not a recommendation."""
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(f"{name} must lie in float32's normal range [{FLOAT32_TINY:.4g}, "
                         f"{FLOAT32_MAX:.4g}] (the kernels divide by it in float32), got "
                         f"{value!r}")


def check_ignore_index(value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise not_static("ignore_index", value, "an int")
    if not -2 ** 63 <= value < 2 ** 63:  # targets are at most int64
        raise ValueError(f"ignore_index must fit in int64, got {value}")


def _check_real(name, value, *, lo=None, hi=None, lo_open=False) -> float:
    """``value`` as a Python float, after the checks (errors name ``name``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise not_static(name, value, "a finite real number")
    value = float(value)
    # comparisons, not math.isfinite: torch.compile(dynamic=True) hands symbolic floats here,
    # which compare (and get specialized) but have no isfinite; NaN fails both comparisons
    if not -math.inf < value < math.inf:
        raise TypeError(f"{name} must be a finite real number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Problem:
    """Sizes of one call after flattening: ``batch_shape`` is the shape of the targets."""

    n: int
    h: int
    v: int
    batch_shape: Tuple[int, ...]


def _hidden_mismatch_hint(x_last: int, weight_shape, weight_layout: str, w_name: str,
                          x_name: str, transpose_hint: str) -> str:
    """Why an input's last dim may miss the weight's H, judged from which dim it does match:
    the weight in the other layout, or logits passed for hidden states (the larger of the
    weight's dims taken for V, as vocabularies outsize hidden sizes)."""
    a, b = weight_shape
    given_h, other = (b, a) if weight_layout == "vh" else (a, b)
    if x_last != other or x_last == given_h:
        return ""
    if other < given_h:  # the dim input matches is the smaller: H, in the other layout
        return (f"; {w_name} looks like (H, V): {transpose_hint}" if weight_layout == "vh" else
                f"; {w_name} looks like (V, H): use weight_layout='vh'")
    return f"; {x_name}'s last dimension is V: pass hidden states, not logits"


def check_shapes(input_shape: Sequence[int], weight_shape: Sequence[int],
                 target_shape: Sequence[int], bias_shape: Optional[Sequence[int]] = None,
                 class_weight_shape: Optional[Sequence[int]] = None, *,
                 weight_layout: str = "vh", names: Sequence[str] = ("input", "target"),
                 transpose_hint: str = "pass linear_weight.T") -> Problem:
    """Shape rules shared by every front door; errors name the offending argument.

    ``input (..., H)``, ``linear_weight (V, H)`` (or ``(H, V)`` with ``weight_layout="hv"``),
    ``target (...)`` with the leading dims of ``input``, ``linear_bias (V,)``, ``weight (V,)``.
    ``names``: what the front door calls ``input`` and ``target`` (JAX: ``x``, ``labels``).
    ``transpose_hint``: the advice for an ``(H, V)`` weight given as ``(V, H)`` (JAX's front
    door can say ``pass weight_layout='hv'``). Messages hint at the usual mix-ups: a
    transposed weight, logits for hidden states, the weight passed first.
    """
    input_shape, weight_shape, target_shape = tuple(input_shape), tuple(weight_shape), tuple(target_shape)
    x_name, y_name = names

    def swapped():  # only on an error path: under torch.compile a comparison adds guards
        return (f"; arguments are ({x_name}, linear_weight, {y_name}): was the weight passed "
                "first?") if weight_shape[:-1] == target_shape else ""
    if weight_layout not in ("vh", "hv"):
        raise ValueError(f"weight_layout must be 'vh' (V, H) or 'hv' (H, V), got {weight_layout!r}")
    if len(input_shape) < 1:
        raise ValueError(f"{x_name} must have at least 1 dimension (..., H), got shape {input_shape}")
    if len(weight_shape) != 2:
        raise ValueError(f"linear_weight must be 2-D, got shape {weight_shape}{swapped()}")
    v, h = weight_shape if weight_layout == "vh" else weight_shape[::-1]
    if input_shape[-1] != h:
        layout = "(V, H)" if weight_layout == "vh" else "(H, V)"
        hint = _hidden_mismatch_hint(input_shape[-1], weight_shape, weight_layout,
                                     "linear_weight", x_name, transpose_hint)
        raise ValueError(
            f"hidden size mismatch: {x_name} has H={input_shape[-1]} but linear_weight {layout} "
            f"has shape {weight_shape}{hint}")
    if v < 1 or h < 1:
        raise ValueError(f"linear_weight must have V >= 1 and H >= 1, got shape {weight_shape}")
    if target_shape != input_shape[:-1]:
        raise ValueError(f"{y_name} must have shape {x_name}.shape[:-1] = {input_shape[:-1]}, "
                         f"got {target_shape}{swapped()}")
    if bias_shape is not None and tuple(bias_shape) != (v,):
        raise ValueError(f"linear_bias must have shape (V,) = ({v},), got {tuple(bias_shape)}")
    if class_weight_shape is not None and tuple(class_weight_shape) != (v,):
        raise ValueError(
            f"weight (class weights) must have shape (V,) = ({v},), got {tuple(class_weight_shape)}")
    n = math.prod(target_shape)  # plain Python (not NumPy) so torch.compile traces it
    return Problem(n=n, h=int(h), v=int(v), batch_shape=target_shape)


def reduction_denominator(token_weight_sum, reduction: str):
    """The divisor of the summed loss: Σω for "mean" (1 when it is 0: see the module docstring),
    else 1.
    A negative Σω (negative class weights) divides as it is, as ``F.cross_entropy`` does."""
    if reduction != "mean":
        return 1.0
    return np.where(token_weight_sum != 0, token_weight_sum, 1.0)


def folds_mean_divisor(reduction: str, dtype_name: str) -> bool:
    """Whether a fused forward that precomputes the gradients for a unit upstream gradient may
    fold "mean"'s 1/Σω into the logit gradients dz before they are rounded to the input dtype.
    Not in float16: dz ≈ p/Σω falls into subnormals or to zero once Σω reaches the tens of
    thousands, and the upstream cotangent (e.g. a loss scale of 2^16) arrives only in backward,
    too late to save them. There backward applies g/Σω (dX rounded a second time); the dW
    accumulator stays fp32, since its unscaled sums could overflow fp16."""
    return reduction == "mean" and dtype_name != "float16"


def reference(x, W, y, *, bias=None, weight=None, options: LinearCrossEntropyOptions = None,
              grad_output=None, grad_lse=None):
    """Float64 forward and *analytic* backward (the formulas above, not autodiff).

    ``grad_output`` is the upstream gradient of the loss (a scalar for "mean"/"sum", ``(N,)``
    for "none"; default ones), ``grad_lse`` that of lse (default 0). Returns a dict with
    ``loss`` (reduced), ``token_loss (N,)``, ``lse (N,)``, ``grad_logits (N, V)`` (= dz),
    ``dx (N, H)``, ``dw (V, H)``, ``db (V,)``.
    """
    opts = options or LinearCrossEntropyOptions()
    x = np.asarray(x, np.float64)
    W = np.asarray(W, np.float64)
    y = np.asarray(y)
    n, v = x.shape[0], W.shape[0]
    check_shapes(x.shape, W.shape, y.shape, None if bias is None else np.shape(bias),
                 None if weight is None else np.shape(weight))
    check_targets(y, v, opts.ignore_index)  # before any cast: float targets are an error
    y = y.astype(np.int64)
    w = np.ones(v) if weight is None else np.asarray(weight, np.float64)
    eps, zeta, s = opts.label_smoothing, opts.z_loss, opts.softcap

    z = x @ W.T + (0.0 if bias is None else np.asarray(bias, np.float64))
    c = z if s is None else s * np.tanh(z / s)
    cmax = c.max(axis=1, keepdims=True)
    lse = (cmax + np.log(np.exp(c - cmax).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(c - lse[:, None])

    m = (y != opts.ignore_index).astype(np.float64)
    y_safe = np.where(m > 0, y, 0)
    omega = m * w[y_safe]
    # An ignored token reads class 0 (y_safe) and a class masked by a -inf bias has lse - c =
    # inf: both are selected away, never multiplied by 0 (0·inf = NaN).
    c_y = np.where(m > 0, c[np.arange(n), y_safe], lse)
    smooth = np.where(m > 0, (w[None, :] * (lse[:, None] - c)).sum(axis=1), 0.0) \
        if eps > 0 else np.zeros(n)
    ce = (1 - eps) * omega * (lse - c_y) + (eps / v) * smooth
    token_loss = ce + zeta * omega * lse ** 2

    denom = reduction_denominator(omega.sum(), opts.reduction)
    loss = token_loss if opts.reduction == "none" else token_loss.sum() / denom

    if grad_output is None:
        grad_output = np.ones(n) if opts.reduction == "none" else 1.0
    g = np.asarray(grad_output, np.float64)
    g_tok = g if opts.reduction == "none" else np.full(n, g / denom)
    g_tok = np.where(m > 0, g_tok, 0.0)  # ignored: 0 whatever g is (inf or NaN included)
    h_tok = np.zeros(n) if grad_lse is None else np.asarray(grad_lse, np.float64)

    A = (1 - eps) * omega + m * (eps / v) * w.sum() + 2 * zeta * omega * lse
    B = (1 - eps) * omega
    dl_dc = A[:, None] * p - m[:, None] * (eps / v) * w[None, :]
    dl_dc[np.arange(n), y_safe] -= B
    dc = g_tok[:, None] * dl_dc + h_tok[:, None] * p
    dz = dc if s is None else dc * (1 - (c / s) ** 2)
    return dict(loss=loss, token_loss=token_loss, lse=lse, grad_logits=dz,
                dx=dz @ W, dw=dz.T @ x, db=dz.sum(axis=0))


def check_targets(y, v: int, ignore_index: int) -> None:
    """Eager target check for host arrays (the reference, and NumPy-backed callers)."""
    y = np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"target must hold integers (class indices), got dtype {y.dtype}")
    bad = (y != ignore_index) & ((y < 0) | (y >= v))
    if bad.any():
        raise ValueError(target_range_message(v, ignore_index, int(y[bad].flat[0])))


def target_range_message(v: int, ignore_index: int, example=None) -> str:
    got = "" if example is None else f" (found {example})"
    return (f"target out of range: every target must be in [0, {v}) or equal ignore_index="
            f"{ignore_index}{got}")
