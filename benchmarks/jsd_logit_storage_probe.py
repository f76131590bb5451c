"""CPU probe: how the dtype the JSD's logits are *stored* in between the logits GEMMs and the
row kernel moves the student's gradients, with everything else exact.

The Triton JSD stores both heads' logits in fp32 (``fp32_logits=True``): 8 bytes per element
of the pair, which its three row passes re-read (the row kernel's cost is that traffic).
Half-width storage would halve it. This probe rounds the exact logits as a store would, then
runs the float64 spec (``specs.linear_jsd.logits_reference``) on them, rounds dz to bf16 as the
kernel does, and reports the relative Frobenius errors of dz, dX and dW (each GEMM in float64,
its result rounded to bf16) against the exact chain, beside the floor (the exact dX / dW
rounded to bf16), and the loss's relative error (the spec on the stored logits). Storage
forms:

* ``fp32``, ``bf16``, ``fp16``: the logit rounded to that dtype;
* ``fp16-tile<k>`` / ``bf16-tile<k>``: z − o rounded, o the maximum of its row's k-column tile
  (fp32, one per tile): what a GEMM epilogue that knows only its own output tile could store;
* ``fp16-row``: z − (row maximum) rounded (for comparison: no epilogue knows it);
* ``<form>-rel`` (e.g. ``fp16-tile256-rel``): the student stored in ``<form>``, the teacher as
  fp16 z_t − ẑ_s beside it (ẑ_s the student as stored: a teacher GEMM epilogue reading the
  student's tile). Measured for nearly equal heads (``--agreement 0.99999``): dz 1.0e-2
  against 1.4e-2 for both heads in tiles, fp32's 2.9e-5: the student's own rounding
  (2⁻¹² of its distance to the tile maximum, ~4e-3 at 14 below it) is as large as the heads'
  difference, so storing that difference well does not save the regime;
* ``<form>-diff``: the teacher as ẑ_s + fp16(z_t − z_s), the heads' difference taken from
  both *exact* fp32 logits (a GEMM holding both heads' tiles at once, which ours does not):
  the pair then shares the student's rounding and keeps its difference. Nearly equal heads
  (``--agreement 0.99999``, with ``+lamsplit``): dz 6.7e-4 against 1.4e-2, dX / dW
  1.9e-3 / 2.4e-3, fp32 logits' level; with unrelated heads worse than ``<form>``, the
  difference being large where P is (forward KL, β = 0: dW 3.0e-3 against 2.3e-3; the JSD
  at T = 0.5: 2.25e-3 against 2.14e-3; ``…-s37-cpu-probe-jsd-rel-diff.txt``);
* ``<form>-choice``: per teacher element whichever of ``<form>``'s remainder below its own
  tile maximum and ``-diff``'s difference is smaller, rounded to the nearest fp16 whose
  lowest bit holds the choice (:func:`choice_round16`; clearing the bit after rounding
  biased the loss: 1.9e-4 off at agreement 0.8): fp32 logits' dX / dW in every regime tried
  (nearly equal heads at T = 1 and 2, the forward KL of unrelated heads, T = 0.25-0.5), the
  loss 1e-6-1e-5 relative off (``…-s37-cpu-probe-jsd-choice.txt``). What a dual-head GEMM
  would have to store for tiles by default;
* any form with ``+lam16`` (0 < β < 1): also Λ = log M − log Q rounded to fp16 before the
  gradient uses it (K summed from the rounded Λ, as the kernel does), i.e. pass 2 leaving Λ in the
  teacher's 16-bit slot for pass 3, which then re-reads only the student's logit. At T < 1
  with dissimilar heads this doubles the gradient errors (``…-s37-cpu-probe-jsd-lambda16``):
  where Q is large P ≪ Q, so Λ ≈ log(1 − β) ≈ −K there, and the gradient's Λ + K keeps
  only the few bits fp16 leaves beside that constant;
* ``+lamsplit``: Λ stored so instead in :func:`split16`'s form (relative to 0 or to
  log(1 − β), whichever is nearer, the choice in the mantissa's lowest bit: the kernel's
  ``jsd_rows._lam_encode`` since the thirty-seventh session).

Inputs as ``benchmarks/linear_jsd.py`` draws them (logit std 2, teacher correlation 0.8, bf16
inputs), a smaller H (the errors come from dz, whose size does not depend on H).

    PYTHONPATH=. python3 benchmarks/jsd_logit_storage_probe.py [--n 32 --v 128256 --h 512]
        [--beta 0.5 --temperature 1 --forms fp32,fp16-tile256+lam16]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from logitless.specs import linear_jsd as spec  # noqa: E402

LOGIT_STD = 2.0  # as benchmarks/linear_jsd.py (and its TEACHER_AGREEMENT 0.8: --agreement)


def _round(a: np.ndarray, dtype) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype).to(torch.float64).numpy()


def stored(z32: np.ndarray, form: str) -> np.ndarray:
    """The logits (fp32 values, as float64) after a store in ``form`` and the load back."""
    if form == "fp32":
        return z32
    if form in ("bf16", "fp16"):
        return _round(z32, getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[form]))
    dtype = torch.float16 if form.startswith("fp16") else torch.bfloat16
    if form.endswith("-row"):
        o = z32.max(axis=1, keepdims=True)
        return _round(_round(z32 - o, dtype) + o, torch.float32)
    o = tile_maxima(z32, int(form.split("-tile")[1]))
    back = _round(_round(z32 - o, torch.float32), dtype) + o  # z − o in fp32, then stored
    return _round(back, torch.float32)


def tile_maxima(z32: np.ndarray, tile: int) -> np.ndarray:
    """Each element's row maximum over its ``tile``-column tile (what the GEMM epilogue
    stores as the offset), broadcast to ``z32``'s shape."""
    n, v = z32.shape
    zp = np.pad(z32, ((0, 0), (0, -v % tile)), constant_values=-np.inf)
    return np.repeat(zp.reshape(n, -1, tile).max(axis=2), tile, axis=1)[:, :v]


def choice_round16(x: np.ndarray, bit: np.ndarray) -> np.ndarray:
    """``x`` (fp32) rounded to the nearest fp16 whose lowest mantissa bit is ``bit`` (a choice
    stored beside the value): spacing 2 ulp, unbiased, unlike clearing the bit after rounding
    (always toward 0: a bias that a plain sum such as the loss keeps)."""
    x = x.astype(np.float32)
    r = x.astype(np.float16)
    bits = r.view(np.int16)
    wrong = (bits & 1) != bit.astype(np.int16)
    # the neighbour on x's side of r: one step up or down in magnitude (sign and magnitude);
    # up from a zero, down from fp16's largest finite value
    mag = bits & np.int16(0x7FFF)
    up = ((np.abs(x) > np.abs(r.astype(np.float32))) | (mag == 0)) & (mag != 0x7BFF)
    bits = np.where(wrong, bits + np.where(up, 1, -1).astype(np.int16), bits).astype(np.int16)
    return bits.view(np.float16).astype(np.float64)


def split16(ell: np.ndarray, beta: float) -> np.ndarray:
    """``ell`` = −Λ = log Q − log M after a 16-bit store in the split form: fp16 of ell where
    ell < ℓ∞/2, of ell − ℓ∞ above (ℓ∞ = −log(1 − β), the value where P ≪ Q), the choice in
    the fp16 mantissa's lowest bit; decoded in fp32 as the kernel would."""
    linf = -math.log(1 - beta)
    upper = ell > linf / 2
    bits = np.where(upper, ell - linf, ell).astype(np.float32).astype(np.float16).view(np.int16)
    bits = (bits & ~np.int16(1)) | upper.astype(np.int16)
    low = (bits & ~np.int16(1)).view(np.float16).astype(np.float32)
    return (low + (bits & 1).astype(np.float32) * np.float32(linf)).astype(np.float64)


def grad_logits(z, zeta, opts, lam16) -> np.ndarray:
    """dz (upstream 1 per token) of the spec from these logits; ``lam16``: the JSD's Λ rounded
    to fp16 where the gradient uses it (the spec's own formulas otherwise): "fp16" as is,
    "split" in :func:`split16`'s form."""
    if not lam16:
        return spec.logits_reference(z, zeta, options=opts)["grad_logits"]
    if opts.kind != "jsd":
        raise SystemExit("+lam16 is for 0 < beta < 1 (the KL kinds have no Λ)")
    T, beta = opts.temperature, opts.beta
    logq = spec._log_softmax(z / T)
    q = np.exp(logq)
    ell, _ = spec._log_ratios_to_m(spec._log_ratio(z, zeta, T, logq, q), beta)  # ell = −Λ
    ell16 = split16(ell, beta) if lam16 == "split" else _round(ell, torch.float16)
    kl = (q * ell16).sum(axis=1, keepdims=True)  # as the kernel: K from the Λ pass 3 reads
    scale = 1.0 / z.shape[0] if opts.reduction == "mean" else 1.0  # no targets: all tokens count
    return scale * (1 - beta) * q * (ell16 - kl) / T


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--h", type=int, default=512)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--agreement", type=float, default=0.8,
                    help="correlation of teacher and student logits (0.99999: nearly equal "
                         "heads, where 16-bit storage of each head loses their difference)")
    ap.add_argument("--forms", default="fp32,bf16,fp16,fp16-tile128,fp16-tile256,bf16-tile128,"
                                       "fp16-row,fp32+lam16,fp16-tile256+lam16")
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(a.seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    scale = LOGIT_STD / math.sqrt(a.h)
    c = math.sqrt(a.agreement)
    xs, ws = r(a.n, a.h), r(a.v, a.h) * scale
    xt = xs * c + r(a.n, a.h) * math.sqrt(1 - c * c)
    wt = ws * c + r(a.v, a.h) * (scale * math.sqrt(1 - c * c))
    bf = lambda t: t.to(torch.bfloat16).to(torch.float64).numpy()  # noqa: E731
    xs, ws, xt, wt = bf(xs), bf(ws), bf(xt), bf(wt)
    opts = spec.LinearJSDOptions(beta=a.beta, temperature=a.temperature)
    z, zeta = xs @ ws.T, xt @ wt.T
    exact_all = spec.logits_reference(z, zeta, options=opts)
    exact, loss_ref = exact_all["grad_logits"], exact_all["loss"]
    dx_ref, dw_ref = exact @ ws, exact.T @ xs
    bf16 = lambda t: _round(t, torch.bfloat16)  # noqa: E731
    rows = [dict(form="floor (exact dX, dW rounded to bf16)", dz=0.0,
                 dx=rel(bf16(dx_ref), dx_ref), dw=rel(bf16(dw_ref), dw_ref), loss=0.0)]
    z32, zeta32 = _round(z, torch.float32), _round(zeta, torch.float32)
    for form in a.forms.split(","):
        base = form.split("+")[0]
        lam16 = {"lam16": "fp16", "lamsplit": "split"}.get(form.split("+")[1]) \
            if "+" in form else None
        if base.endswith("-choice"):  # per element: own tile maximum or the exact difference
            zs_st = stored(z32, base[:-7])
            o = tile_maxima(zeta32, int(base[:-7].split("-tile")[1]))
            own, dif = (zeta32 - o).astype(np.float32), (zeta32 - z32).astype(np.float32)
            use_dif = np.abs(dif) < np.abs(own)
            val = choice_round16(np.where(use_dif, dif, own), use_dif)
            zt_st = np.where(use_dif, _round(zs_st + val, torch.float32),
                             _round(o + val, torch.float32))
        elif base.endswith("-diff"):  # the teacher as ẑ_s + fp16(z_t − z_s), z_s exact
            zs_st = stored(z32, base[:-5])
            zt_st = _round(zs_st + _round(_round(zeta32 - z32, torch.float32), torch.float16),
                           torch.float32)
        elif base.endswith("-rel"):  # the teacher as fp16 z_t − ẑ_s beside the stored student
            zs_st = stored(z32, base[:-4])
            zt_st = _round(zs_st + _round(_round(zeta32 - zs_st, torch.float32), torch.float16),
                           torch.float32)
        else:
            zs_st, zt_st = stored(z32, base), stored(zeta32, base)
        dz = grad_logits(zs_st, zt_st, opts, lam16)
        dzb = bf16(dz)  # the row kernel writes dz in the input dtype
        loss = spec.logits_reference(zs_st, zt_st, options=opts)["loss"]  # J keeps fp32 Λ
        rows.append(dict(form=form, dz=rel(dz, exact), dx=rel(bf16(dzb @ ws), dx_ref),
                         dw=rel(bf16(dzb.T @ xs), dw_ref), loss=abs(loss - loss_ref) / loss_ref))
    print(json.dumps(dict(n=a.n, v=a.v, h=a.h, beta=a.beta, temperature=a.temperature,
                          seed=a.seed, agreement=a.agreement)))
    print(f"{'storage':40s} {'dz err':>9s} {'dX err':>9s} {'dW err':>9s} {'loss err':>9s}")
    for row in rows:
        print(f"{row['form']:40s} {row['dz']:9.2e} {row['dx']:9.2e} {row['dw']:9.2e} "
              f"{row['loss']:9.2e}")


if __name__ == "__main__":
    main()
