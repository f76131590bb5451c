r"""Fused linear JSD (distillation): the one definition every backend implements.

Inputs (after flattening the leading dims): student ``x_s (N, H_s)``, ``W_s (V, H_s)``;
teacher ``x_t (N, H_t)``, ``W_t (V, H_t)`` (``H_s`` and ``H_t`` may differ, ``V`` may not);
optional targets ``y (N,)``, used only to skip tokens (``ignore_index``) and by the optional
hard-label term. Options: ``β`` (beta), ``T`` (temperature), ``w_h`` (hard_loss_weight),
``ignore_index``, ``reduction``.

Forward, per token i (all arithmetic in fp32 or wider)::

    z_iv = x_s,i · W_s,v       ζ_iv = x_t,i · W_t,v       student / teacher logits
    a_iv = z_iv / T            b_iv = ζ_iv / T
    log Q_iv = a_iv − lse_v(a_i)      Q = softmax(student / T)
    log P_iv = b_iv − lse_v(b_i)      P = softmax(teacher / T)

    0 < β < 1:  M = β·P + (1−β)·Q
                J_i = β·KL(P‖M) + (1−β)·KL(Q‖M)
                    = Σ_v β·P_v·(log P_v − log M_v) + (1−β)·Q_v·(log Q_v − log M_v)
    β = 0:      J_i = KL(P‖Q) = Σ_v P_v·(log P_v − log Q_v)        (forward KL)
    β = 1:      J_i = KL(Q‖P) = Σ_v Q_v·(log Q_v − log P_v)        (reverse KL)

    ce_i = lse_v(z_i) − z_{i,y_i}     hard-label cross-entropy, on the raw logits (no T)
    m_i  = 0 if y_i == ignore_index else 1     (1 for every token when no targets are given)
    l_i  = m_i · (J_i + w_h · ce_i)

This is Liger-Kernel's generalized JSD (``LigerFusedLinearJSD``; its hard-label term is that
of ``LigerFusedLinearJSDLoss`` with ``weight_soft_loss = 1``): no T² factor, the teacher is a
constant. **The endpoints are defined, not inherited**: the general formula degenerates at
β = 0 (M = Q, so J = KL(Q‖Q) = 0) and at β = 1 (M = P, J = 0). For small β,
J_β = β·KL(P‖Q) + O(β²), so the β = 0 case is lim J_β/β (and β = 1 is lim J_β/(1−β)): the
stated KLs, exactly as Liger special-cases them, and the loss is discontinuous in β there.

Reductions::

    "none": l_i        "sum": Σ_i l_i        "mean": Σ_i l_i / Σ_i m_i

and ``mean`` of a batch whose tokens are all ignored (Σ m = 0) is 0, never NaN.

Backward (the student's logits only; the teacher gets no gradient). Let g_i be the upstream
gradient of token i's loss — ``g`` for "sum", ``g/Σm`` for "mean" (0 when Σm = 0), ``g_i`` for
"none". With ∂/∂z = (1/T)·∂/∂a and ∂Q_u/∂a_v = Q_u·(δ_uv − Q_v)::

    0 < β < 1:  ∂J/∂Q_v = (1−β)·ℓ_v,   ℓ_v = log Q_v − log M_v      (P held fixed)
                ∂J/∂a_v = (1−β)·Q_v·(ℓ_v − K),   K = Σ_u Q_u·ℓ_u = KL(Q‖M)
    β = 0:      ∂J/∂a_v = Q_v − P_v
    β = 1:      ∂J/∂a_v = Q_v·(λ_v − K'),   λ_v = log Q_v − log P_v,   K' = Σ_u Q_u·λ_u = KL(Q‖P) = J
    ∂ce/∂z_v  = S_v − [v = y],   S = softmax(z)  (= Q when T = 1)

    dz_iv = g_i · m_i · ( (1/T)·∂J_i/∂a_iv + w_h·(S_iv − [v = y_i]) )
    dX_s = dz · W_s        dW_s = dzᵀ · X_s

(The general case: J = β·Σ P log P + (1−β)·Σ Q log Q − Σ M log M, since Σ_v M_v log M_v =
Σ_v (β P_v + (1−β) Q_v) log M_v; differentiating in Q_v gives (1−β)(log Q_v + 1 − log M_v − 1).)
Ignored tokens have m = 0: zero loss, zero gradient, whatever their upstream gradient (an inf
or NaN there gives 0, not NaN·0).

Precision notes for implementations:

* Every per-element log ratio must be formed without cancellation, since J (and, for β near
  0 or 1, the whole loss) can be far smaller than the logits: log Q − log M =
  −log1p(β·expm1(δ)) with δ = log P − log Q, and for β > ``HIGH_BETA`` log P − log M =
  −log1p((1−β)·expm1(−δ)). A difference of log-probabilities or of logsumexps loses
  everything as β → 0 or 1 (the loss scales with β or 1 − β). And 1 − β must come from the
  caller's β in float64, never as 1 − fp32(β): for β > ``HIGH_BETA`` and δ < −1, where
  1 − β carries log M/Q, that is logaddexp(log β + δ, log(1 − β)).
* δ itself must not be a difference of log-softmaxes (their O(|z|/T) terms' rounding swamps
  a J second order in δ where the heads nearly agree): δ = d − c with d = (z_t − z_s)/T and
  the normalizer gap c = L_b − L_a = log E_Q[e^d] from log1p(E_Q[expm1(·)]) about a reference
  (the kernels in fp32, logitless/triton_kernels/jsd_rows.py; the reference in float64), and
  Q − P (β = 0) as −Q·expm1(δ) where P ≈ Q.
* J is a difference of nearly equal quantities when student and teacher agree, and its
  gradient has no exact dominant term (unlike cross-entropy's −onehot), so logits rounded to
  bf16 by the GEMM (|z|·2⁻⁹ absolute) move the gradient by ~1e-2 relative. The reference
  GEMMs therefore produce fp32 logits (see the backends).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import numpy as np

from .linear_cross_entropy import (REDUCTIONS, _check_real, _hidden_mismatch_hint,
                                   check_float32_normal, check_ignore_index, check_targets,
                                   reduction_denominator)

# Thresholds of the fp32 forms every kernel uses (Triton, Pallas, XLA; the derivation is in
# logitless/triton_kernels/jsd_rows.py): one definition, so that the backends cannot drift.
FAR = 30.0    # b − a (or δ) beyond which the heads are far apart: no expm1 overflow, and the
              # plain difference / log β + δ are exact enough
EXPM1_MAX = 80.0  # the largest δ the kernels give expm1 (β·e^80 stays finite in fp32)
TINY_BETA = 1e-20  # below it far_delta(β) passes EXPM1_MAX: the kernels' "tiny" form


def far_delta(beta: float) -> float:
    """δ = log P − log Q beyond which, for 0 < β <= HIGH_BETA, log M/Q = log β + δ and
    log P/M = −log β to fp32 (the neglected log1p((1−β)/β·e^−δ) is below e^−FAR): FAR, pushed
    out by log((1−β)/β) for small β. Inside it the kernels take log1p(β·expm1(δ)) (for
    β < TINY_BETA, logaddexp(log β + δ, log(1 − β)) past EXPM1_MAX), outside it those limits
    (δ − log M/Q would keep only ulp(δ) there)."""
    return FAR + max(0.0, math.log1p(-beta) - math.log(beta))


def beta_form(beta: float) -> int:
    """Which fp32 forms a kernel compiles for 0 < β < 1: 0 (TINY_BETA <= β <= HIGH_BETA),
    1 (β > HIGH_BETA: the P-term's own forms) or 2 (β < TINY_BETA: log M/Q as a logaddexp
    past EXPM1_MAX)."""
    return 1 if beta > HIGH_BETA else 2 if beta < TINY_BETA else 0


GAP = 1.0     # |L_b − L_a| from which the normalizer gap is the plain difference (the log1p
              # form cancels when E_Q[expm1(b − a)] = e^c − 1 is near −1)
SMALL = 0.1   # |argument| below which expm1 / log1p use their Taylor polynomials
# A row takes the accurate ("near") gap c = log1p(E_Q[expm1(d)]) and δ = d − c where max d <
# FAR and |gap| < GAP, except where both heads are saturated (normalizer sums s_a, s_b below
# 1 + SMALL: all but < 10% of each mass on its maximum) and |gap| >= SMALL: there log(1 + y)
# keeps only ~ulp(1) of c, which the KLs' Σ P·d − c left (±1e-7 where they are ~0), while the
# far form, each head relative to its own maximum, is exact at a shared top token.
HIGH_BETA = 0.5  # β above which the P-term's log P − log M = δ − Λ cancels (→ 0 as β → 1):
                 # kernels take −log1p((1−β)·expm1(−δ)) there (logaddexp(log β, log(1−β) − δ)
                 # where −δ > FAR), accurate to a few ulps relative whatever β

__all__ = ["LinearJSDOptions", "Problem", "check_shapes", "reference", "token_mask"]


@dataclasses.dataclass(frozen=True)
class LinearJSDOptions:
    """The loss options, validated once here; backends read them, never re-check them."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    reduction: str = "mean"
    hard_loss_weight: float = 0.0

    def __post_init__(self):
        for name, lo, hi, lo_open in (("beta", 0.0, 1.0, False),
                                      ("temperature", 0.0, None, True),
                                      ("hard_loss_weight", 0.0, None, False)):
            object.__setattr__(self, name, _check_real(name, getattr(self, name), lo=lo, hi=hi,
                                                       lo_open=lo_open))
        check_float32_normal("temperature", self.temperature)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        check_ignore_index(self.ignore_index)
        object.__setattr__(self, "ignore_index", int(self.ignore_index))

    @property
    def kind(self) -> str:
        """``"forward_kl"`` (β = 0), ``"reverse_kl"`` (β = 1) or ``"jsd"`` (0 < β < 1)."""
        return "forward_kl" if self.beta == 0.0 else "reverse_kl" if self.beta == 1.0 else "jsd"

    @property
    def has_hard_loss(self) -> bool:
        return self.hard_loss_weight > 0.0


@dataclasses.dataclass(frozen=True)
class Problem:
    """Sizes of one call after flattening; ``batch_shape`` is the inputs' leading shape."""

    n: int
    h_s: int
    h_t: int
    v: int
    batch_shape: Tuple[int, ...]


def check_shapes(student_input_shape: Sequence[int], student_weight_shape: Sequence[int],
                 teacher_input_shape: Sequence[int], teacher_weight_shape: Sequence[int],
                 target_shape: Optional[Sequence[int]] = None, *,
                 options: Optional[LinearJSDOptions] = None,
                 weight_layout: str = "vh") -> Problem:
    """Shape rules shared by every front door; errors name the offending argument.

    ``student_input (..., H_s)``, ``student_weight (V, H_s)``, ``teacher_input (..., H_t)`` with
    the same leading dims, ``teacher_weight (V, H_t)``, ``target (...)`` (optional; required
    when ``options.hard_loss_weight > 0``). With ``weight_layout="hv"`` both weights are
    ``(H, V)`` (and the messages say so, with the shapes as given).
    """
    if weight_layout not in ("vh", "hv"):
        raise ValueError(f"weight_layout must be 'vh' (V, H) or 'hv' (H, V), got {weight_layout!r}")
    xs, xt = tuple(student_input_shape), tuple(teacher_input_shape)
    ws_given, wt_given = tuple(student_weight_shape), tuple(teacher_weight_shape)
    lay = "(V, H)" if weight_layout == "vh" else "(H, V)"
    for name, shape in (("student_input", xs), ("teacher_input", xt)):
        if len(shape) < 1:
            raise ValueError(f"{name} must have at least 1 dimension (..., H), got shape {shape}")
    for name, shape in (("student_weight", ws_given), ("teacher_weight", wt_given)):
        if len(shape) != 2:
            raise ValueError(f"{name} must be 2-D {lay}, got shape {shape}")
    ws = ws_given if weight_layout == "vh" else ws_given[::-1]
    wt = wt_given if weight_layout == "vh" else wt_given[::-1]
    v, h_s = ws
    if xs[-1] != h_s:
        raise ValueError(f"hidden size mismatch: student_input has H={xs[-1]} but student_weight "
                         f"{lay} has shape {ws_given}"
                         + _hidden_mismatch_hint(xs[-1], ws_given, weight_layout,
                                                 "student_weight", "student_input",
                                                 "pass student_weight.T"))
    if wt[0] != v:
        hint = ("; teacher_weight looks like (H, V): pass teacher_weight.T"
                if weight_layout == "vh" and wt[1] == v and wt[0] == xt[-1] else "")
        raise ValueError(f"vocabulary mismatch: student_weight has V={v} but teacher_weight "
                         f"{lay} has shape {wt_given}" + hint)
    h_t = wt[1]
    if xt[-1] != h_t:
        raise ValueError(f"hidden size mismatch: teacher_input has H={xt[-1]} but teacher_weight "
                         f"{lay} has shape {wt_given}"
                         + _hidden_mismatch_hint(xt[-1], wt_given, weight_layout,
                                                 "teacher_weight", "teacher_input",
                                                 "pass teacher_weight.T"))
    if xt[:-1] != xs[:-1]:
        raise ValueError(f"teacher_input must have the leading shape of student_input "
                         f"{xs[:-1]}, got {xt[:-1]}")
    if v < 1 or h_s < 1 or h_t < 1:
        raise ValueError(f"weights must have V >= 1 and H >= 1, got student_weight {ws_given} "
                         f"and teacher_weight {wt_given}")
    if target_shape is not None and tuple(target_shape) != xs[:-1]:
        raise ValueError(f"target must have shape student_input.shape[:-1] = {xs[:-1]}, "
                         f"got {tuple(target_shape)}")
    if target_shape is None and options is not None and options.has_hard_loss:
        raise ValueError("hard_loss_weight > 0 needs target (the hard labels)")
    n = math.prod(xs[:-1])  # plain Python (not NumPy) so torch.compile traces it
    return Problem(n=n, h_s=int(h_s), h_t=int(h_t), v=int(v), batch_shape=xs[:-1])


def token_mask(y, n: int, ignore_index: int):
    """m (N,) float64: 0 for ignored tokens, 1 otherwise (all ones without targets)."""
    return np.ones(n) if y is None else (np.asarray(y) != ignore_index).astype(np.float64)


def _log_softmax(u):
    mx = u.max(axis=1, keepdims=True)
    return u - (mx + np.log(np.exp(u - mx).sum(axis=1, keepdims=True)))


def _log_ratio(z, zeta, T, logq, q):
    """δ = log P − log Q (N, V) of the student / teacher logits z, ζ, without cancellation.

    A difference of the two log-softmaxes keeps their O(|z|/T) terms' rounding (~1e-15), which
    swamps a KL of nearly equal heads (second order in δ: 2e-4 relative off for heads 1e-5
    apart). As the kernels do: δ = d − c with d = (ζ − z)/T (scaled after the difference:
    exactly 0 for equal heads) and the normalizer gap c = L_b − L_a = log E_Q[e^d], both about
    the row's r = E_Q[d]: δ = (d − r) − log1p(E_Q[expm1(d − r)]). By Jensen E_Q[e^(d−r)] >= 1,
    so the log1p never cancels, at any spread; r's own rounding shifts both terms alike. Rows
    where some d − r passes ``big`` (expm1 would overflow) take log E_Q[e^(d−r)] as a
    logsumexp of log Q + d − r: the heads are far apart there, δ large."""
    d = (zeta - z) / T
    x = d - (q * d).sum(axis=1, keepdims=True)
    big = 500.0  # V·e^500 stays finite; Q's underflow (e^-745) is negligible below it
    u = logq + x
    um = u.max(axis=1, keepdims=True)
    lse = um + np.log(np.exp(u - um).sum(axis=1, keepdims=True))
    near = np.log1p((q * np.expm1(np.minimum(x, big))).sum(axis=1, keepdims=True))
    return x - np.where(x.max(axis=1, keepdims=True) > big, lse, near)


def _log_ratios_to_m(delta, beta):
    """(log Q − log M, log P − log M) from δ = log P − log Q, for 0 < β < 1, in the forms
    that do not cancel (the kernels' forms, in float64): log M/Q = log1p(β·expm1(δ)) for
    β <= HIGH_BETA, and log M/P = log1p((1−β)·expm1(−δ)) above it; each as a logaddexp
    where expm1 would overflow. Plain differences of log M had lost the small one of the two
    as β → 0 (or 1): at β = 1e-25 the reference's dz was all 0 (a review, against 60-digit
    arithmetic)."""
    big = 700.0  # expm1 overflows float64 past ~709
    if beta <= HIGH_BETA:
        lam = np.where(delta > big, np.logaddexp(np.log(beta) + delta, np.log1p(-beta)),
                       np.log1p(beta * np.expm1(np.minimum(delta, big))))
        # δ − Λ cancels where Λ ≈ log β + δ (far apart): −log(β + (1−β)·e^−δ) there
        lpm = np.where(delta > FAR, -np.logaddexp(np.log(beta), np.log1p(-beta) - delta),
                       delta - lam)
        return -lam, lpm
    mu = np.where(-delta > big, np.logaddexp(np.log1p(-beta) - delta, np.log(beta)),
                  np.log1p((1.0 - beta) * np.expm1(np.minimum(-delta, big))))
    return -delta - mu, -mu


def reference(x_s, W_s, x_t, W_t, y=None, *, options: LinearJSDOptions = None,
              grad_output=None):
    """Float64 forward and *analytic* backward (the formulas above, not autodiff).

    ``grad_output`` is the upstream gradient of the loss (a scalar for "mean"/"sum", ``(N,)``
    for "none"; default ones). Returns a dict with ``loss`` (reduced), ``token_loss (N,)``
    (l_i), ``jsd (N,)`` (J_i), ``ce (N,)`` (ce_i, zeros without targets), ``grad_logits (N, V)``
    (dz), ``dx (N, H_s)`` and ``dw (V, H_s)``.
    """
    opts = options or LinearJSDOptions()
    x_s, W_s = np.asarray(x_s, np.float64), np.asarray(W_s, np.float64)
    x_t, W_t = np.asarray(x_t, np.float64), np.asarray(W_t, np.float64)
    check_shapes(x_s.shape, W_s.shape, x_t.shape, W_t.shape,
                 None if y is None else np.shape(y), options=opts)
    n, v = x_s.shape[0], W_s.shape[0]
    if y is not None:
        check_targets(y, v, opts.ignore_index)
    out = logits_reference(x_s @ W_s.T, x_t @ W_t.T, y, options=opts, grad_output=grad_output)
    dz = out["grad_logits"]
    return dict(out, dx=dz @ W_s, dw=dz.T @ x_s)


def logits_reference(z, zeta, y=None, *, options: LinearJSDOptions = None, grad_output=None):
    """:func:`reference` from the logits: the student's ``z`` and the teacher's ``zeta``
    (N, V), float64 math whatever their dtype (a probe feeds logits rounded as a kernel would
    store them). Returns its dict without ``dx`` and ``dw``."""
    opts = options or LinearJSDOptions()
    z, zeta = np.asarray(z, np.float64), np.asarray(zeta, np.float64)
    n = z.shape[0]
    if y is not None:
        y = np.asarray(y).astype(np.int64)
    beta, T = opts.beta, opts.temperature

    logq = _log_softmax(z / T)
    q, p = np.exp(logq), np.exp(_log_softmax(zeta / T))
    delta = _log_ratio(z, zeta, T, logq, q)
    with np.errstate(divide="ignore"):  # log β or log(1−β) at the endpoints, unused there
        if opts.kind == "forward_kl":
            jsd = (p * delta).sum(axis=1)
            # Q − P = −Q·expm1(δ): the difference cancels where P ≈ Q
            da = np.where(np.abs(delta) < 1.0, -q * np.expm1(np.minimum(delta, 1.0)), q - p)
        elif opts.kind == "reverse_kl":
            lam = -delta
            jsd = (q * lam).sum(axis=1)
            da = q * (lam - jsd[:, None])
        else:
            ell, lpm = _log_ratios_to_m(delta, beta)
            kl_qm = (q * ell).sum(axis=1)
            jsd = beta * (p * lpm).sum(axis=1) + (1 - beta) * kl_qm
            da = (1 - beta) * q * (ell - kl_qm[:, None])

    m = token_mask(y, n, opts.ignore_index)
    ce = np.zeros(n)
    dce = np.zeros_like(z)
    if y is not None:
        y_safe = np.where(m > 0, y, 0)
        logs = _log_softmax(z)
        ce = -logs[np.arange(n), y_safe] * m
        dce = np.exp(logs)
        dce[np.arange(n), y_safe] -= 1.0
    token_loss = m * (jsd + opts.hard_loss_weight * ce)

    denom = reduction_denominator(m.sum(), opts.reduction)
    loss = token_loss if opts.reduction == "none" else token_loss.sum() / denom
    if grad_output is None:
        grad_output = np.ones(n) if opts.reduction == "none" else 1.0
    g = np.asarray(grad_output, np.float64)
    g_tok = g if opts.reduction == "none" else np.full(n, g / denom)
    g_tok = np.where(m > 0, g_tok * m, 0.0)  # ignored: 0 whatever g is (inf or NaN included)
    dz = g_tok[:, None] * (da / T + opts.hard_loss_weight * dce)
    return dict(loss=loss, token_loss=token_loss, jsd=jsd, ce=ce, grad_logits=dz)
