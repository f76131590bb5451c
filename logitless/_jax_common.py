"""JAX-side pieces shared by the front door and both JAX backends (``xla``, ``pallas``).

* argument checks and flattening (errors name the argument), the eager target check;
* per-token coefficients of the loss and its gradient, and the per-chunk loss math in jnp
  (the same functions run inside the Pallas kernel and in the plain-XLA backend);
* the GEMMs of either weight layout, and the chunked ``jax.custom_vjp`` driver that walks the
  token chunks of :func:`logitless.specs.tiling.plan_token_chunks`.

A backend only supplies a *head*: what to do with one chunk of raw logits (loss and lse, and
optionally the logit gradient written in the logits' dtype). See :class:`Head`.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import numbers
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .specs import linear_cross_entropy as spec
from .specs.tiling import (BALANCE_MULTIPLE, ChunkPlan, balanced, ceil_div, padded_vocab,
                           plan_token_chunks)

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_INT32 = np.iinfo(np.int32)


# ------------------------------------------------------------------- elementwise exp / log
# The per-element math below runs in XLA and inside Pallas kernels. In a kernel compiled for
# a GPU, Pallas lowers jnp.exp / jnp.log to libdevice's expf / logf (~15-20 instructions
# each), while Triton's tl.exp / tl.log, which the Triton kernels use, are one MUFU
# instruction after a multiply: the Pallas JSD passes were issue-bound on them (H100, ncu:
# 94% issue-active). A kernel body traced inside ``kernel_math(fns)`` gets ``fns`` (an object
# with ``exp`` and ``log``: ``pallas_kernels._launch.PTX_MATH``) from :func:`exp` /
# :func:`log`; everywhere else (XLA, interpret mode, the row merges between launches) they
# are jnp's.
_KERNEL_MATH = contextvars.ContextVar("logitless_kernel_math", default=None)


@contextlib.contextmanager
def kernel_math(fns):
    token = _KERNEL_MATH.set(fns)
    try:
        yield
    finally:
        _KERNEL_MATH.reset(token)


def exp(x):
    fns = _KERNEL_MATH.get()
    return jnp.exp(x) if fns is None else fns.exp(x)


def log(x):
    fns = _KERNEL_MATH.get()
    return jnp.log(x) if fns is None else fns.log(x)


# ------------------------------------------------------------------------------ arguments
@dataclasses.dataclass(frozen=True)
class Prepared:
    x: jax.Array                       # (N, H)
    w: jax.Array                       # (V, H) for layout "vh", (H, V) for "hv" (never copied)
    y: jax.Array                       # (N,) int32
    bias: Optional[jax.Array]          # (V,)
    class_weight: Optional[jax.Array]  # (V,) float32
    layout: str
    problem: spec.Problem
    # which gradients (dX, dW, db) the caller will use: the fused forward computes and keeps
    # only those (the PyTorch bridge knows which tensors require grad: a frozen head costs no
    # dW GEMM and no float32 [V, H] accumulator); a skipped one is a zero cotangent
    needs: Tuple[bool, bool, bool] = (True, True, True)


def _require_array(name, a, optional=False):
    if a is None and optional:
        return
    if not isinstance(a, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax.Array (or NumPy array), got {type(a).__name__}")


def _is_traced(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def check_int32_ignore_index(ignore_index: int, targets: str, advice: str = "") -> None:
    """JAX's targets are int32 (without x64): an ignore_index beyond it could never match one.
    ``targets``: what the caller calls them; ``advice``: appended to the message."""
    if not _INT32.min <= ignore_index <= _INT32.max:
        raise ValueError(f"ignore_index must fit in int32 ({targets} are int32), got "
                         f"{ignore_index}{advice}")


def check_concrete_labels(labels, v: int, ignore_index: int) -> None:
    """``ValueError`` for a label outside ``[0, v)`` that is not ``ignore_index``, read on the
    host, if ``labels`` is concrete; traced labels cannot be read without a sync."""
    if not _is_traced(labels):
        spec.check_targets(np.asarray(labels), v, ignore_index)


def prepare(x, linear_weight, labels, linear_bias, weight, *, ignore_index: int,
            weight_layout: str = "vh", check_range: bool = True,
            vocab_axis=None) -> Prepared:
    """Check types, dtypes and shapes (errors name the argument); flatten to 2-D.

    Concrete (untraced) labels are range-checked here, eagerly (this reads them on the host);
    traced labels are not, and the backends turn an out-of-range target into a NaN loss.
    Inside ``shard_map`` the arrays are cast to vary over the same manual axes
    (:func:`match_varying`; ``vocab_axis``, the vocab-parallel axis, excepted).
    """
    _require_array("x", x)
    _require_array("linear_weight", linear_weight)
    _require_array("labels", labels)
    _require_array("linear_bias", linear_bias, optional=True)
    _require_array("weight", weight, optional=True)
    dt = jnp.dtype(x.dtype)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {dt}")
    if jnp.dtype(linear_weight.dtype) != dt:
        raise TypeError(f"linear_weight dtype {linear_weight.dtype} does not match x dtype {dt}")
    if linear_bias is not None and jnp.dtype(linear_bias.dtype) != dt:
        raise TypeError(f"linear_bias dtype {linear_bias.dtype} does not match x dtype {dt}")
    ldt = jnp.dtype(labels.dtype)
    if ldt == jnp.bool_ or not jnp.issubdtype(ldt, jnp.integer):
        raise TypeError(f"labels must hold integer class indices, got dtype {ldt}; "
                        "class-probability targets are not supported")
    if weight is not None and not jnp.issubdtype(jnp.dtype(weight.dtype), jnp.floating):
        raise TypeError(f"weight (class weights) must be a floating array, got {weight.dtype}")
    check_int32_ignore_index(ignore_index, "labels")
    problem = spec.check_shapes(x.shape, linear_weight.shape, labels.shape,
                                None if linear_bias is None else linear_bias.shape,
                                None if weight is None else weight.shape,
                                weight_layout=weight_layout, names=("x", "labels"),
                                transpose_hint="pass weight_layout='hv'")
    if check_range:
        check_concrete_labels(labels, problem.v, ignore_index)
    x, linear_weight, labels, linear_bias, weight = match_varying(
        x, linear_weight, labels, linear_bias, weight, exclude=vocab_axis)
    return Prepared(
        x=jnp.reshape(x, (problem.n, problem.h)), w=jnp.asarray(linear_weight),
        y=labels_int32(jnp.reshape(labels, (problem.n,)), ignore_index),
        bias=None if linear_bias is None else jnp.asarray(linear_bias),
        class_weight=None if weight is None else jnp.asarray(weight, jnp.float32),
        layout=weight_layout, problem=problem)


# ------------------------------------------------------- shard_map and mesh-axis typing
# Inside ``jax.shard_map`` (check_vma=True, the default) every value carries the manual mesh
# axes it varies over, and a custom_vjp's cotangent must have its primal's type. A replicated
# weight used with data-parallel tokens has a dW that varies over the data axis: the weight is
# cast to varying first (``lax.pcast``), whose transpose is the psum that makes the summed dW.
def varying_axes(a) -> frozenset:
    """The manual mesh axes ``a`` varies over (empty outside ``shard_map`` / with
    check_vma=False, and for None)."""
    if a is None:
        return frozenset()
    mat = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def _axis_names(axis_name) -> frozenset:
    if axis_name is None:
        return frozenset()
    return frozenset(axis_name) if isinstance(axis_name, (tuple, list)) else \
        frozenset([axis_name])


def to_varying(a, axes):
    """``a`` (or None) cast to vary over ``axes`` too (no-op where it does already)."""
    missing = frozenset(axes) - varying_axes(a)
    if a is None or not missing:
        return a
    if not hasattr(lax, "pcast"):  # a JAX without it has no varying types to match
        return a
    return lax.pcast(a, tuple(sorted(missing, key=str)), to="varying")


def match_varying(*arrays, exclude=None):
    """``arrays`` (None kept) all cast to vary over the union of their varying axes, minus
    ``exclude`` (a vocab-parallel axis: x and labels stay invariant over it, as its psums
    make dX)."""
    axes = frozenset().union(*map(varying_axes, arrays)) - _axis_names(exclude)
    return tuple(to_varying(a, axes) for a in arrays) if axes else arrays


def zeros_like_axes(shape, dtype, like):
    """``jnp.zeros`` varying over the axes ``like`` varies over: a loop carry that the loop
    body fills with values computed from ``like`` must start with their type."""
    return to_varying(jnp.zeros(shape, dtype), varying_axes(like))


def _explicit_mesh(args):
    """(mesh, its Explicit axes, whether it is the context mesh) for the mesh that shards
    ``args`` with Explicit axes (part of the arrays' types): the context mesh
    (``jax.sharding.set_mesh``) if one is set, else that of an argument's sharding;
    (None, (), False) when there is none."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    cur = None if get is None else get()
    if cur is not None and not getattr(cur, "empty", True):
        return cur, tuple(getattr(cur, "explicit_axes", ())), True
    for a in jax.tree_util.tree_leaves(args):
        try:  # a concrete array's sharding has its devices (an eager call needs them)
            sharding = a.sharding if isinstance(a, jax.Array) and not _is_traced(a) else \
                jax.typeof(a).sharding
        except (TypeError, AttributeError):
            continue
        mesh = getattr(sharding, "mesh", None)
        axes = tuple(getattr(mesh, "explicit_axes", ()) or ())
        if axes:
            return mesh, axes, False
    return None, (), False


def spec_of(a, ndim=None) -> tuple:
    """``a``'s PartitionSpec entries, ``ndim`` of them (``a.ndim`` by default; None pads)."""
    try:
        spec = tuple(getattr(getattr(jax.typeof(a), "sharding", None), "spec", None) or ())
    except TypeError:  # not an array: the op's own checks name it
        spec = ()
    ndim = np.ndim(a) if ndim is None else ndim
    return (spec + (None,) * ndim)[:ndim]


def on_auto_axes(fn, args, out_specs):
    """``fn(*args)``, under ``jax.sharding.auto_axes`` over the Explicit mesh axes when some
    shard ``args``: the ops' chunk loops slice and update token ranges, which an Explicit
    token sharding forbids (dynamic_update_slice of a sharded carry, slices of Pallas refs);
    inside, the compiler partitions the body as it does any jit's (GSPMD). ``out_specs``: a
    thunk returning the outputs' PartitionSpecs (a pytree like them), called only then."""
    mesh, axes, in_context = _explicit_mesh(args)
    if not axes or not hasattr(jax.sharding, "auto_axes"):
        return fn(*args)
    out = out_specs()
    if not in_context:  # no mesh set: auto_axes takes it from the out shardings
        out = jax.tree_util.tree_map(lambda spec: jax.sharding.NamedSharding(mesh, spec), out,
                                     is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out)(*args)


def labels_int32(y, ignore_index: int):
    """Labels as int32 (what the kernels index with). A wider label outside int32's range
    becomes a value that is neither a class nor ``ignore_index`` (an out-of-range target, so
    NaN, as any other), never a wrapped-around class or ignored token."""
    info = jnp.iinfo(y.dtype)
    fits = None  # bounds in y's own dtype: a Python -2^31 would wrap for unsigned labels
    if info.max > _INT32.max:
        fits = y <= np.array(_INT32.max, y.dtype)
    if info.min < _INT32.min:
        low = y >= np.array(_INT32.min, y.dtype)
        fits = low if fits is None else fits & low
    y32 = y.astype(jnp.int32)
    if fits is None:
        return y32
    return jnp.where(fits, y32, jnp.int32(-1 if ignore_index != -1 else -2))


def check_tuning(name: str, value, *, power_of_2=False, lo=1, hi=None):
    """A positive-int tuning keyword (optionally a power of two within [lo, hi]), returned as
    a Python int (NumPy integers are accepted; bools are not)."""
    what = "a power of two" if power_of_2 else "an int"
    static = isinstance(value, (numbers.Integral, np.bool_))  # a bool: the ValueError below
    if getattr(value, "shape", None) == () and not static:  # a 0-d array or a traced value
        raise spec.not_static(name, value, "an int")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo or \
            (hi is not None and value > hi) or (power_of_2 and value & (value - 1)):
        rng = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}"
        raise ValueError(f"{name} must be {what}{rng}, got {value!r}")
    return int(value)


# ------------------------------------------------------------------- per-token coefficients
# Rows of the packed (6, N) float32 coefficient array (see the spec's docstring):
#   B = (1-ε)ω,  SM = m·ε/V,  SMO = SM·Ω,  ZW = ζ·ω,  G = upstream grad of l_i,  H = of lse_i
# so that  l_i  = B(lse − c_y) + SMO·lse − SM·Σ_v w_v c_v + ZW·lse²
#          dc_iv = G·((B + SMO + 2·ZW·lse)·p − B·[v=y] − SM·w_v) + H·p.
B, SM, SMO, ZW, G, H = range(6)
NUM_COEFS = 6


def token_coefficients(y, class_weight, opts: spec.LinearCrossEntropyOptions, v: int):
    """(6, N) float32 coefficients with G = H = 0, and ω (N,).

    A target outside ``[0, V)`` that is not ``ignore_index`` gets ω = NaN: its loss, the reduced
    loss and the gradients become NaN (loud, never garbage), and no index ever leaves ``[0, V)``.
    """
    mask = y != opts.ignore_index
    bad = mask & ((y < 0) | (y >= v))
    y_safe = jnp.where(mask & ~bad, y, 0)
    m = mask.astype(jnp.float32)
    omega = m if class_weight is None else m * class_weight[y_safe]
    omega = jnp.where(bad, jnp.nan, omega)
    eps = opts.label_smoothing
    sm = m * (eps / v)
    big_omega = float(v) if class_weight is None else jnp.sum(class_weight)
    zero = jnp.zeros_like(m)
    coefs = jnp.stack([(1.0 - eps) * omega, sm, sm * big_omega, opts.z_loss * omega, zero, zero])
    return coefs, omega


def column_targets(y, opts, v: int):
    """Targets with ignored and out-of-range ones mapped to -1, matching no column: an ignored
    token must not read its ``ignore_index`` column (a real class, maybe masked by a -inf
    bias: 0·inf = NaN in its zero-weighted loss)."""
    keep = (y != opts.ignore_index) & (y >= 0) & (y < v)
    return jnp.where(keep, y, -1)


def mean_denominator(omega):
    """Σω, or 1 where Σω = 0 so that an all-ignored batch gives loss 0 and zero grads."""
    total = jnp.sum(omega)
    return jnp.where(total != 0, total, 1.0)  # negative Σω divides, as in F.cross_entropy


def with_upstream(coefs, g, h):
    """Fill the G and H rows (``g``, ``h`` broadcast to (N,))."""
    n = coefs.shape[1]
    return coefs.at[G].set(jnp.broadcast_to(g, (n,))).at[H].set(jnp.broadcast_to(h, (n,)))


# ------------------------------------------------------------- per-chunk math (jnp, fp32)
# Written for row blocks: per-row values have shape (R,), logit blocks (R, C). They run
# unchanged inside the Pallas kernel and on whole chunks in the XLA backend.
def capped(z, softcap: Optional[float]):
    return z if softcap is None else softcap * jnp.tanh(z / softcap)


def token_loss(lse, c_y, wc, b, sm, smo, zw):
    """l_i from lse_i, the target logit c_y, the smoothing sum wc = Σ_v w_v c_v (or None)."""
    loss = b * (lse - c_y) + zw * lse * lse
    if wc is not None:  # sm = 0 for an ignored token, whose wc may be −inf (0·inf = NaN)
        loss = loss + jnp.where(sm != 0, smo * lse - sm * wc, 0.0)
    return loss


def grad_logits(c, lse, is_target, class_w, b, sm, smo, zw, g, h, *, softcap, smoothing):
    """dz for a block of capped logits ``c`` (R, C); ``class_w`` is (C,) or None (all ones)."""
    p = exp(c - lse[:, None])
    a = g * (b + smo + 2.0 * zw * lse) + h
    dc = a[:, None] * p - jnp.where(is_target, (g * b)[:, None], 0.0)
    if smoothing:
        s = (g * sm)[:, None]
        dc = dc - (s if class_w is None else s * class_w[None, :])
    if softcap is not None:
        dc = dc * (1.0 - (c / softcap) ** 2)
    return dc


# ------------------------------------------------------------------- GEMMs of either layout
def _precision(*arrays):
    """float32 GEMMs in full float32, as PyTorch does by default: XLA's DEFAULT precision on a
    GPU rounds float32 operands to TF32-like precision (~3e-4 relative error). Half-precision
    operands are exact either way, so they keep DEFAULT (and its fast paths)."""
    if any(a.dtype == jnp.float32 for a in arrays):
        return lax.Precision.HIGHEST
    return None


# Rows below which a GEMM's result is asked for in float32 and rounded after it: for so few
# rows XLA's GPU emits a split-K Triton GEMM that rounds its partial sums to a half-precision
# output before adding them (H100, 1 row: bf16 relative error 2.65e-3 against 1.91e-3 rounded
# once; from 2 rows on equal). The float32 result of so few rows costs nothing.
FEW_ROWS = 64


def _dot(a, b, dims, dtype):
    """``a·b`` (dot_general ``dims``) with float32 accumulation and one rounding to ``dtype``."""
    prec = _precision(a, b)
    if a.shape[0] < FEW_ROWS and jnp.dtype(dtype).itemsize < 4:
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                               precision=prec).astype(dtype)
    return lax.dot_general(a, b, dims, preferred_element_type=dtype, precision=prec)


def logits(xc, w, layout, dtype=None):
    """(C, V) raw logits in ``dtype`` (default: the input dtype; fp32 accumulation inside)."""
    dims = (((1,), (1,)), ((), ())) if layout == "vh" else (((1,), (0,)), ((), ()))
    return _dot(xc, w, dims, dtype or xc.dtype)


def grad_input(dz, w, layout, dtype=None):
    """dz·W (either weight layout), fp32 accumulation, the result in ``dtype`` (dz's by
    default)."""
    dims = (((1,), (0,)), ((), ())) if layout == "vh" else (((1,), (1,)), ((), ()))
    return _dot(dz, w, dims, dtype or dz.dtype)


def grad_weight(dz, xc, layout):
    """dzᵀ·x as (V, H) (or x ᵀ·dz as (H, V) for "hv"), in float32."""
    dims = (((0,), (0,)), ((), ()))
    prec = _precision(dz, xc)
    if layout == "vh":
        return lax.dot_general(dz, xc, dims, preferred_element_type=jnp.float32, precision=prec)
    return lax.dot_general(xc, dz, dims, preferred_element_type=jnp.float32, precision=prec)


class VocabWeight:
    """The head weight as the chunk GEMMs take it: its vocabulary padded with zero rows to a
    multiple of 8 (:func:`logitless.specs.tiling.padded_vocab`) when it is not one already.

    Why: V is a leading dimension of the logits and of dz, and XLA's GPU GEMMs take slow kernels
    when it is not a multiple of 8 (H100, N=10000, H=1600, V=50257, fwd+bwd of the Pallas CE:
    19.4 ms; padded 9.66 ms, floor 7.0; the GEMMs cut at the aligned bulk instead, 13.1 ms, as
    XLA then copies the logits into one odd-width buffer and dz's bulk out of it).
    Padded, every buffer has an aligned width ``vp``; the padded classes' logits are x·0 = 0
    and their gradient is 0 (heads that take the padded logits write it; for the others the
    driver trims the logits and pads dz, which XLA fuses into the head's passes), so dX is
    exact and dW's padded rows, zero, are trimmed (:func:`trim_vocab`) where the caller scales
    or casts it. The price: a padded copy of the weight per call, alive through the chunk loop
    (V·H elements: 1.1 GB at H=3584, V=151655 in bf16), and ``vp - V`` more fp32 rows of dW.
    """

    def __init__(self, w, layout: str):
        self.layout = layout
        axis = _vocab_axis(layout)
        self.v = w.shape[axis]
        self.vp = padded_vocab(self.v)
        pad = [(0, 0), (0, 0)]
        pad[axis] = (0, self.vp - self.v)
        self.w = w if self.vp == self.v else jnp.pad(w, pad)

    def logits(self, xc, dtype=None):
        """(C, vp) logits."""
        return logits(xc, self.w, self.layout, dtype)

    def grad_input(self, dz, dtype=None):
        """dz (C, vp)·W."""
        return grad_input(dz, self.w, self.layout, dtype)

    def grad_weight(self, dz, xc):
        """(vp, H) float32 (or (H, vp) for "hv")."""
        return grad_weight(dz, xc, self.layout)

    def zero_grad_weight(self, like):
        return zeros_like_axes(self.w.shape, jnp.float32, like)

    def trim(self, z):
        """The real classes' columns of (C, vp) logits."""
        return z if self.vp == self.v else z[:, :self.v]

    def pad(self, dz):
        """(C, V) gradient padded with zeros to (C, vp)."""
        return dz if self.vp == self.v else jnp.pad(dz, ((0, 0), (0, self.vp - self.v)))


def _vocab_axis(layout: str) -> int:
    return 0 if layout == "vh" else 1


def trim_vocab(dw, v: int, layout: str):
    """dW of :meth:`VocabWeight.grad_weight` without its padded rows (None stays None)."""
    if dw is None or dw.shape[_vocab_axis(layout)] == v:
        return dw
    return lax.slice_in_dim(dw, 0, v, axis=_vocab_axis(layout))


# ------------------------------------------------------------------------ chunked driver
class Head:
    """What a backend does with one chunk of raw logits ``z`` (C, V) in the input dtype.

    ``loss_lse(z, y, coefs, bias, cw)`` -> (loss (C,), lse (C,)) in float32;
    ``loss_lse_grad(z, y, coefs, bias, cw, grad_dtype)`` -> (loss, lse, dz) with dz (C, V) in
    ``grad_dtype`` (the input dtype, which the dX/dW GEMMs take), using the G/H rows of
    ``coefs`` (6, C). ``bias`` is added to ``z`` by the head. ``logits_dtype`` says in which
    dtype the driver's GEMM hands ``z`` over (None: the input dtype). Heads are hashable
    (they are static configuration of the traced program).

    ``takes_padded_vocab``: True for a head that takes the logits with the padded classes of
    :class:`VocabWeight` (width ``vp``) and the keyword ``v`` (the real V), and returns dz of
    width ``vp``, zero in the padded columns (a kernel, to which XLA would otherwise hand a
    trimmed copy). Other heads get (C, V) logits; the driver pads their dz.
    """

    logits_dtype = None
    takes_padded_vocab = False


def head_loss_lse(head: Head, wv: "VocabWeight", z, *args):
    """:meth:`Head.loss_lse` of the (C, vp) logits ``z`` of ``wv``."""
    if head.takes_padded_vocab:
        return head.loss_lse(z, *args, v=wv.v)
    return head.loss_lse(wv.trim(z), *args)


def head_loss_lse_grad(head: Head, wv: "VocabWeight", z, *args):
    """:meth:`Head.loss_lse_grad` of the (C, vp) logits ``z`` of ``wv``; dz (C, vp)."""
    if head.takes_padded_vocab:
        return head.loss_lse_grad(z, *args, v=wv.v)
    loss, lse, dz = head.loss_lse_grad(wv.trim(z), *args)
    return loss, lse, wv.pad(dz)


@dataclasses.dataclass(frozen=True)
class _Static:
    opts: spec.LinearCrossEntropyOptions
    plan: ChunkPlan
    v: int
    layout: str
    head: Head
    needs: Tuple[bool, bool, bool] = (True, True, True)  # see Prepared.needs


def walk(n: int, size: int, body, carry, start0: int = 0):
    """``carry = body(start, length, carry)`` over [start0, start0 + n) in pieces of ``size``:
    the first piece on its own (so ``body`` may create accumulators by assignment there), a
    ``lax.fori_loop`` over the other full pieces, then the ragged tail (all lengths static).
    (Unrolling the loop was measured on an H100, linear JSD at 8192 tokens: slower, 74 vs
    72.5 ms, and XLA then kept 11 GB of temporaries instead of 4.6.)"""
    full, tail = divmod(n, size)
    if n == 0:
        return carry
    carry = body(start0, size if full else tail, carry)
    if full > 1:
        carry = lax.fori_loop(1, full, lambda i, c: body(start0 + i * size, size, c), carry)
    if full and tail:
        carry = body(start0 + full * size, tail, carry)
    return carry


def token_plan(n: int, v: int, *, bytes_per_element: int, budget_bytes, chunk_size):
    """The chunk plan (:func:`logitless.specs.tiling.plan_token_chunks`); chunks from the budget
    made equal (``balanced``), so that the drivers can pad the tokens to a whole number of them
    (:func:`padded_tokens`). A ``chunk_size`` given is kept."""
    plan = plan_token_chunks(n, v, bytes_per_element=bytes_per_element,
                             budget_bytes=budget_bytes, chunk_size=chunk_size)
    return balanced(plan) if chunk_size is None else plan


def padded_tokens(n: int, size: int) -> int:
    """n, or n padded to whole pieces of ``size`` where that adds under BALANCE_MULTIPLE tokens
    per piece (a balanced plan): every piece then runs through the loop's one traced body. A
    ragged last piece is another body, whose buffers XLA does not share with the loop's (H100,
    JSD pallas at N = 8192: 4.2-5.8 GB of temporaries with a ragged last chunk, 2.6-3.2 GB
    without; CE pallas at N=10000, V=151655: 6.6 GB with chunks 2 x 3456 + 3088). A
    ``chunk_size`` the user gave pads by the same rule: at most 8 tokens a chunk, a lot only
    for tiny chunks (N=9 in chunks of 8: 16 rows)."""
    pieces = ceil_div(n, size) if n else 0
    return pieces * size if 0 < pieces * size - n < BALANCE_MULTIPLE * pieces else n


def pad_tokens(a, n: int, value=0, axis: int = 0):
    """``a`` (or None) padded with ``value`` to n tokens along ``axis``."""
    if a is None or a.shape[axis] == n:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, n - a.shape[axis])
    return jnp.pad(a, pad, constant_values=value)


def _walk_chunks(st: _Static, n: int, body, carry):
    """``carry = body(start, size, carry)`` over the plan's chunks (see :func:`walk`)."""
    return walk(n, st.plan.chunk, body, carry)


def _tokens(a, start, size, axis=0):
    """Tokens [start, start+size) of a per-token array (their axis is ``axis``)."""
    return lax.dynamic_slice_in_dim(a, start, size, axis=axis)


def _forward(st: _Static, x, w, bias, y, cw):
    """Loss and lse without gradients: per-token losses (N,), lse (N,), ω (N,)."""
    n = x.shape[0]
    coefs, omega = token_coefficients(y, cw, st.opts, st.v)
    y = column_targets(y, st.opts, st.v)
    wv = VocabWeight(w, st.layout)
    # padding tokens (zero states, no target, zero coefficients: loss 0) are sliced off
    n_p = padded_tokens(n, st.plan.chunk)
    x, y, coefs = pad_tokens(x, n_p), pad_tokens(y, n_p, -1), pad_tokens(coefs, n_p, axis=1)

    def body(start, size, carry):
        tok, lse = carry
        z = wv.logits(_tokens(x, start, size), st.head.logits_dtype)
        l_c, lse_c = head_loss_lse(st.head, wv, z, _tokens(y, start, size),
                                   _tokens(coefs, start, size, axis=1), bias, cw)
        return (lax.dynamic_update_slice_in_dim(tok, l_c, start, 0),
                lax.dynamic_update_slice_in_dim(lse, lse_c, start, 0))

    zeros = zeros_like_axes((n_p,), jnp.float32, x)
    tok, lse = _walk_chunks(st, n_p, body, (zeros, zeros))
    return tok[:n], lse[:n], omega


def mean_scales(reduction: str, dtype, total):
    """(forward scale, backward scale) of a fused forward's unit-upstream gradients: 1/Σ in
    the forward where the spec's rule lets it fold into dz, else in backward (fp16 "mean")."""
    if reduction != "mean":
        return 1.0, jnp.ones((), jnp.float32)
    inv = 1.0 / mean_denominator(total)
    if spec.folds_mean_divisor(reduction, jnp.dtype(dtype).name):
        return inv, jnp.ones((), jnp.float32)
    return 1.0, inv


def _reduce(st: _Static, tok, omega):
    if st.opts.reduction == "none":
        return tok
    total = jnp.sum(tok)
    return total / mean_denominator(omega) if st.opts.reduction == "mean" else total


def _grads(st: _Static, x, w, bias, y, cw, coefs):
    """One sweep computing loss/lse *and* dX, dW (fp32, with the padded rows of
    :class:`VocabWeight`: see :func:`trim_vocab`), db (fp32) for the G/H in ``coefs``; a
    gradient ``st.needs`` does not want is not computed (None)."""
    n = x.shape[0]
    need_dx, need_dw, need_db = st.needs
    need_db = need_db and bias is not None
    y = column_targets(y, st.opts, st.v)
    wv = VocabWeight(w, st.layout)
    # padding tokens (zero states, no target, zero coefficients: zero gradient) are sliced off
    n_p = padded_tokens(n, st.plan.chunk)
    x, y, coefs = pad_tokens(x, n_p), pad_tokens(y, n_p, -1), pad_tokens(coefs, n_p, axis=1)

    def body(start, size, carry):
        tok, lse, dx, dw, db = carry
        xc = _tokens(x, start, size)
        z = wv.logits(xc, st.head.logits_dtype)
        l_c, lse_c, dz = head_loss_lse_grad(st.head, wv, z, _tokens(y, start, size),
                                            _tokens(coefs, start, size, axis=1), bias, cw,
                                            x.dtype)
        if need_dx:
            dx = lax.dynamic_update_slice_in_dim(dx, wv.grad_input(dz), start, 0)
        # the first chunk assigns the fp32 accumulators: no zero-fill, no read of [V, H] zeros
        if need_dw:
            dw_c = wv.grad_weight(dz, xc)
            dw = dw_c if dw is None else dw + dw_c
        if need_db:
            db_c = jnp.sum(wv.trim(dz).astype(jnp.float32), axis=0)
            db = db_c if db is None else db + db_c
        return (lax.dynamic_update_slice_in_dim(tok, l_c, start, 0),
                lax.dynamic_update_slice_in_dim(lse, lse_c, start, 0), dx, dw, db)

    zeros = zeros_like_axes((n_p,), jnp.float32, x)
    dx0 = zeros_like_axes(x.shape, x.dtype, x) if need_dx else None
    tok, lse, dx, dw, db = _walk_chunks(st, n_p, body, (zeros, zeros, dx0, None, None))
    if n == 0:  # no tokens at all
        dw = wv.zero_grad_weight(x) if need_dw else None
        db = zeros_like_axes(bias.shape, jnp.float32, x) if need_db else None
    return tok[:n], lse[:n], None if dx is None else dx[:n], dw, db


def constants(*arrays):
    """``arrays`` as the custom_vjp rules' gradient computations take inputs that get no
    cotangent (class weights, the JSD teacher): constants at every order, so that grad of grad
    has no cross terms with them either (d/dweight of dL/dx had been 0.53, d/dteacher of
    dL/dstudent 2.4e-2). Applied in the rules, not at the front door, where the residuals of
    the recomputing rules would become copies of the inputs. None stays None."""
    return tuple(None if a is None else lax.stop_gradient(a) for a in arrays)


@functools.lru_cache(maxsize=256)
def _custom_vjp_fn(st: _Static):
    """The differentiable ``(x, w, bias, y, cw) -> loss`` or ``-> (loss, lse)`` for ``st``,
    jit-compiled: an eager call then compiles once per ``st`` and input signature, not on every
    call (under an outer ``jax.jit`` the inner one is inlined).

    mean/sum without lse ("fused"): the forward rule runs the single gradient sweep for an
    upstream gradient of 1 (the gradient is linear in it) and the backward rule only scales
    dX, dW, db by the scalar cotangent: one logits GEMM per chunk instead of two. dW stays in
    fp32 until then; dX is kept in the input dtype, so a cotangent that is not a power of two
    rounds it twice. Otherwise ("none" or lse returned: per-token cotangents) the backward
    rule recomputes every chunk.
    """
    opts = st.opts
    fused = opts.reduction != "none" and not opts.return_lse

    if fused:
        @jax.custom_vjp
        def f(x, w, bias, y, cw):
            tok, _, omega = _forward(st, x, w, bias, y, cw)
            return _reduce(st, tok, omega)

        def f_fwd(x, w, bias, y, cw):
            cw, = constants(cw)
            coefs, omega = token_coefficients(y, cw, opts, st.v)
            # 1/Σω goes into dz (rounded once) or, in fp16, into the backward's scale
            scale, post = mean_scales(opts.reduction, x.dtype, omega)
            coefs = with_upstream(coefs, scale, 0.0)
            tok, _, dx, dw, db = _grads(st, x, w, bias, y, cw, coefs)
            return _reduce(st, tok, omega), (dx, dw, db, post, jnp.zeros((), x.dtype))  # dtype tag

        def f_bwd(res, g):
            dx, dw, db, post, dt = res[0], res[1], res[2], res[3], res[4].dtype
            g = g.astype(jnp.float32) * post
            # x, linear_weight and linear_bias share one dtype (prepare checks)
            scale = lambda a: None if a is None else (g * a.astype(jnp.float32)).astype(dt)
            return scale(dx), scale(trim_vocab(dw, st.v, st.layout)), scale(db), None, None

        f.defvjp(f_fwd, f_bwd)
        return jax.jit(f)

    @jax.custom_vjp
    def f(x, w, bias, y, cw):
        tok, lse, omega = _forward(st, x, w, bias, y, cw)
        return _reduce(st, tok, omega), lse

    def f_fwd(x, w, bias, y, cw):
        tok, lse, omega = _forward(st, x, w, bias, y, cw)
        return (_reduce(st, tok, omega), lse), (x, w, bias, y, cw, omega)

    def f_bwd(res, cts):
        x, w, bias, y, cw, omega = res
        cw, omega = constants(cw, omega)
        g, h = cts
        g = g.astype(jnp.float32)
        if opts.reduction == "mean":
            g = g / mean_denominator(omega)
        # an ignored token's gradient is 0 whatever its upstream g (F.cross_entropy's rule):
        # selected, as g·0 would turn an inf or NaN there into NaN in every dW row
        g = jnp.where(y != opts.ignore_index, g, 0.0)
        coefs, _ = token_coefficients(y, cw, opts, st.v)
        coefs = with_upstream(coefs, g, h.astype(jnp.float32))
        _, _, dx, dw, db = _grads(st, x, w, bias, y, cw, coefs)
        dw = trim_vocab(dw, st.v, st.layout)
        return (dx, None if dw is None else dw.astype(w.dtype),
                None if db is None else db.astype(bias.dtype), None, None)

    f.defvjp(f_fwd, f_bwd)
    return jax.jit(f)


def chunked_linear_cross_entropy(p: Prepared, opts: spec.LinearCrossEntropyOptions,
                                 plan: ChunkPlan, head: Head):
    """Returns ``(loss, lse)`` (lse None unless ``opts.return_lse``); loss flat for "none"."""
    st = _Static(opts=opts, plan=plan, v=p.problem.v, layout=p.layout, head=head, needs=p.needs)
    out = _custom_vjp_fn(st)(p.x, p.w, p.bias, p.y, p.class_weight)
    if opts.reduction != "none" and not opts.return_lse:
        return out, None
    return out
