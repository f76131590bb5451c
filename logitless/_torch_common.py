"""PyTorch-side pieces shared by the front door and every torch backend: argument checks,
flattening, the no-sync target check, the loss math on one chunk of logits, and the
in-place fp32 weight-gradient accumulation."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import warnings
from typing import Optional

import torch

from ._keywords import jsd_not_vocab_parallel, unexpected_keyword
from .specs import linear_cross_entropy as spec
from .specs.tiling import VOCAB_ALIGN, vocab_parts  # noqa: F401  (re-exported to the kernels)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass
class Prepared:
    x: torch.Tensor               # (N, H)
    w: torch.Tensor               # (V, H), possibly non-contiguous (e.g. a transposed tied embedding)
    y: torch.Tensor               # (N,) integer
    bias: Optional[torch.Tensor]  # (V,)
    class_weight: Optional[torch.Tensor]  # (V,) float32/float64
    problem: spec.Problem


# reduction -> the int code the torch.library ops take (their schemas have no strings)
REDUCTION_CODES = {"none": 0, "sum": 1, "mean": 2}
_REDUCTION_NAMES = {code: name for name, code in REDUCTION_CODES.items()}

# Raised by every backend's backward under create_graph=True (format with op=...).
NO_DOUBLE_BACKWARD = (
    "{op} has no double backward (create_graph=True) on any backend: its backward is a "
    "fused, chunked computation that is not itself differentiable. For a penalty on the "
    "gradient, compute that loss unfused (F.linear, then the loss).")


def reduction_name(code: int) -> str:
    """The reduction's name for an op's int ``code`` (see REDUCTION_CODES)."""
    return _REDUCTION_NAMES[code]


def folds_mean(reduction_code: int, dtype: torch.dtype) -> bool:
    """The spec's rule (:func:`~logitless.specs.linear_cross_entropy.folds_mean_divisor`): may
    a fused forward fold "mean"'s divisor into dz (not in fp16)."""
    return spec.folds_mean_divisor(_REDUCTION_NAMES[reduction_code], dtype_name(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    """"float16" for torch.float16: the dtype names the framework-free specs use."""
    return str(dtype).rsplit(".", 1)[-1]


def is_int(value) -> bool:
    """A Python int, bool excluded: what size keywords accept (as the spec's chunk plan)."""
    return isinstance(value, int) and not isinstance(value, bool)


def autocast_inputs(*tensors):
    """Under ``torch.autocast`` on the tensors' device, floating tensors cast to its dtype,
    as ``F.linear`` would (the fused op replaces ``F.linear`` + cross-entropy); else as is.
    float64 is left alone, as autocast leaves it. Gradients flow back through the casts to
    the original (e.g. fp32 master) weights."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not _autocast_enabled(first.device.type):
        return tensors
    dt = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() and
                 t.dtype != torch.float64 else t for t in tensors)


def triton_gpu(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA GPU, where the Triton backends run. ROCm builds of
    PyTorch call their GPUs "cuda" too, but the kernels are written and measured for NVIDIA's
    32-lane warps (32-warp programs would be 2048 threads on a 64-lane CDNA GPU)."""
    return device.type == "cuda" and getattr(torch.version, "hip", None) is None


def triton_usable(device: torch.device, loaded: dict) -> bool:
    """Whether a front door whose loaded backends are ``loaded`` can run Triton on ``device``."""
    return triton_gpu(device) and "triton" in loaded


def available_backends(device: torch.device, loaded: dict) -> list:
    """The PyTorch front doors' backends that can run on ``device``: Triton where its kernels
    run, "torch", and "pallas" (the JAX port, through the bridge) where JAX is installed."""
    return ((["triton"] if triton_usable(device, loaded) else []) + ["torch"]
            + (["pallas"] if importlib.util.find_spec("jax") is not None else []))


def check_triton_device(t: torch.Tensor, name: str, what: str, interpreted: bool) -> None:
    """The error for a tensor the Triton kernels cannot run on (``what``: which kernels)."""
    if t.is_cuda and not triton_gpu(t.device):
        raise NotImplementedError(f"{what} is written for NVIDIA GPUs and untested on ROCm; "
                                  "use backend='torch'")
    if not (t.is_cuda or interpreted):
        raise ValueError(f"{what} needs CUDA tensors (or TRITON_INTERPRET=1 for testing); "
                         f"{name} is on {t.device}")


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 result straight from half-precision operands (CUDA: no upcast
    copies; elsewhere the operands are upcast)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def thin_mm_(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
             add: bool = False) -> torch.Tensor:
    """``out = a @ b`` (``out += a @ b`` with ``add``) for a GEMM over fewer than 8 vocabulary
    rows (those past the aligned bulk of :func:`vocab_parts`, or a whole V or vocabulary chunk
    under 8), with an fp32 result rounded once into ``out``:
    an output a few columns wide invites cuBLAS to split K, and with PyTorch's default
    ``allow_{bf16,fp16}_reduced_precision_reduction`` it may then sum the parts in half
    precision. Tiny (rows x < 8), so the fp32 result costs nothing."""
    r = mm_f32(a, b)
    return out.add_(r) if add else out.copy_(r)


# cuBLAS takes its fast kernels (16-byte vectorized; on Hopper the sm90 ones) only when a GEMM's
# dimensions are multiples of 8 half-precision elements: at an odd vocabulary (GPT-2's 50257)
# every GEMM with V as a dimension fell to sm75 "align1" kernels at ~1/6 the speed (H100
# profile, DESIGN.md). Those GEMMs go in two parts (specs.tiling.vocab_parts): the 8-aligned
# bulk of the vocabulary rows, then the < 8 left.
def vocab_mm_(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, axis: int) -> torch.Tensor:
    """``out = a @ b`` where ``out``'s dimension ``axis`` runs over vocabulary rows (the logits'
    columns, axis 1; a dW slice's rows, axis 0): one GEMM per :func:`vocab_parts` part, those
    under 8 rows through :func:`thin_mm_`, in ``out``'s dtype."""
    for s, e in vocab_parts(out.shape[axis]):
        a_p, b_p, o_p = (a, b[:, s:e], out[:, s:e]) if axis == 1 else (a[s:e], b, out[s:e])
        if e - s < VOCAB_ALIGN:  # the rows past the aligned bulk, or a V / chunk below 8
            thin_mm_(a_p, b_p, o_p)
        else:
            torch.mm(a_p, b_p, out=o_p)
    return out


# dX GEMM row pieces: as many rows as one wave of 256 x 128 output tiles covers (cuBLAS's tile
# for these shapes). The whole K = V loop then runs once per SM, with no partial last wave. H200,
# dX [rows, 128256] @ [128256, 4096] alone (results/nvidia-h200-s33-dx-rows-llama.jsonl): 1.27 us
# per token at 1024 rows (128 tiles) against 1.53 at 1792 and 1.47 at 8192. Whole calls,
# interleaved A/B against whole chunks (…-s33-dx-rows-ab.jsonl): CE Llama 0.98x, JSD 0.985x,
# low-memory 0.993x; but CE Gemma (H = 2304, chunks of 4096) 1.010x in pieces of 1792 and
# 1.042x in pieces of 1024, though 1792 rows ran faster alone. So only from H = 4096 on.
DX_TILE_ROWS, DX_TILE_COLS = 256, 128
DX_SPLIT_MIN_H = 4096


def dx_piece_rows(h: int, device: torch.device) -> int:
    """Default rows per dX GEMM call (``dx_chunk_size``): on a CUDA device and from
    ``DX_SPLIT_MIN_H`` on, one wave of output tiles (at least one tile row); else 0 (whole
    chunks)."""
    if device.type != "cuda" or h < DX_SPLIT_MIN_H:
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return DX_TILE_ROWS * max(1, sms // -(-h // DX_TILE_COLS))


def check_dx_chunk_size(dx_chunk_size, like: torch.Tensor) -> int:
    """The ``dx_chunk_size`` keyword checked (None or a positive int), None resolved with
    :func:`dx_piece_rows` for ``like`` ([N, H] input): rows per dX GEMM call."""
    if dx_chunk_size is None:
        return dx_piece_rows(like.shape[-1], like.device)
    if not is_int(dx_chunk_size) or dx_chunk_size < 1:
        raise ValueError(f"dx_chunk_size must be a positive int, got {dx_chunk_size!r}")
    return int(dx_chunk_size)


def mm_over_vocab(dz: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  rows: int = 0) -> torch.Tensor:
    """``out = dz @ w`` where the contraction runs over the vocabulary (``dz [C, V]``,
    ``w [V, H]``), in parts (:func:`vocab_parts`) summed in fp32 and rounded once into ``out``;
    in GEMMs of at most ``rows`` rows each when ``rows`` > 0 (:func:`dx_piece_rows`)."""
    if 0 < rows < dz.shape[0]:
        for s in range(0, dz.shape[0], rows):
            mm_over_vocab(dz[s:s + rows], w, out[s:s + rows])
        return out
    parts = vocab_parts(w.shape[0])
    if len(parts) == 1 and out.dtype == dz.dtype:
        return torch.mm(dz, w, out=out)
    acc = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32,
                                                             device=out.device)
    for i, (s, e) in enumerate(parts):
        accumulate_mm_(acc, dz[:, s:e], w[s:e], first=i == 0)
    if acc is not out:
        out.copy_(acc)
    return out


ROW_ALIGN = 16  # logits rows padded to 16 elements: vectorized row kernels, aligned cuBLAS ld


def rows_buffer(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A ``[rows, cols]`` buffer whose rows start at 16-element boundaries (a view of
    ``[rows, cols rounded up to 16]``): the row kernels' loads and stores then vectorize and
    cuBLAS gets an aligned leading dimension whatever the vocabulary size (e.g. 50257)."""
    return torch.empty(rows, -(-cols // ROW_ALIGN) * ROW_ALIGN, dtype=dtype,
                       device=device)[:, :cols]


def load_cols(cols: int, *bufs: torch.Tensor) -> int:
    """How many columns of each row of ``bufs`` a row kernel may load and store: ``cols``
    rounded up to 16 where every row of every buffer has that many (the padded rows of
    :func:`rows_buffer`), else ``cols``. Triton vectorizes a masked load only when its bound
    is a multiple of the vector width: at ``cols`` = 50257 each lane loaded alone, and the CE
    row kernel took 2.6x as long as at 50272 (H100). The kernels still mask their sums and
    selects at ``cols``; what they write past it is padding, which no GEMM reads.

    Only for buffers of our own (:func:`rows_buffer` views, from column 0): the check cannot
    tell padding from live columns, so a view of a user's wider tensor would get up to 15 of
    its neighbouring columns overwritten by a kernel that writes (every caller passes our
    buffers)."""
    wide = -(-cols // ROW_ALIGN) * ROW_ALIGN
    for b in bufs:
        if b.shape[0] == 0:
            continue
        if b.stride(1) != 1 or b.stride(0) < wide:
            return cols
        last_row_end = b.storage_offset() + (b.shape[0] - 1) * b.stride(0) + wide
        if last_row_end * b.element_size() > b.untyped_storage().nbytes():
            return cols
    return wide


def on_device(t: torch.Tensor):
    """A context making ``t``'s CUDA device current (else nothing). Triton launches on the
    current device and its stream, not on the tensors': a model split over GPUs (e.g. a
    transformers ``device_map="auto"`` head on cuda:1) would otherwise launch on the wrong one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def autocast_off(device: torch.device):
    """A context without autocast on ``device``: the backends pick their own dtypes (fp32
    GEMMs for fp32 statistics), which autocast would otherwise recast inside them."""
    if _autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _autocast_enabled(device_type: str) -> bool:
    # devices autocast does not know (meta, ...) raise instead of answering False
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def _require_tensor(name, t, optional=False):
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, by class name: importing torch.distributed.tensor costs
    time on every import, and torch.distributed need not be available."""
    return t is not None and type(t).__name__ == "DTensor"


def _refuse_dtensor(name, t):
    if is_dtensor(t):
        raise TypeError(
            f"{name} is a DTensor (a sharded parameter, e.g. FSDP2 outside the module's "
            "forward): call the loss inside the sharded module's forward, where FSDP2 hands "
            "over plain tensors, or give a vocab-parallel head's local slice with "
            "process_group=")


def refuse_forward_ad(op: str, *named) -> None:
    """NotImplementedError if a tensor of ``named`` ((name, tensor or None) pairs) carries a
    forward-mode tangent (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``): the
    ops register only a backward, and forward AD through them would silently give a zero
    tangent. Outside a dual level ``unpack_dual`` returns at once (a fraction of a µs)."""
    for name, t in named:
        if t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{op} does not support forward-mode AD (torch.func.jvp, jacfwd, "
                f"torch.autograd.forward_ad): {name} carries a tangent. Its fused backward is "
                "reverse mode only; use torch.autograd (loss.backward(), torch.autograd.grad), or "
                "compute it unfused.")


def widen_targets(y: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Targets as int64 unless already int32/int64 holding ``ignore_index``: compared in their
    own dtype, uint8 targets would wrap -100 to 156 (a valid class ignored, an out-of-range
    one accepted) and int32 ones could not hold an ignore_index beyond int32."""
    if y.dtype == torch.int64:
        return y
    if y.dtype == torch.int32 and -2**31 <= ignore_index < 2**31:
        return y
    return y.long()


def load_backend(loaded: dict, modules: dict, name: str):
    """The module of backend ``name`` (``modules[name]``), imported once into ``loaded``. A
    dict lookup on the hot path: torch.compile traces it without a break. A first import under
    torch.compile (``"pallas"`` imports JAX) runs outside the trace, or Dynamo would compile
    the frames the import runs; wrapped only then, as ``torch.compiler.disable`` imports
    ``torch._dynamo``, which ``import logitless.torch`` should not pay for."""
    mod = loaded.get(name)
    if mod is None:
        def load():
            loaded[name] = importlib.import_module(modules[name])
            return loaded[name]
        mod = (torch.compiler.disable(load) if torch.compiler.is_compiling() else load)()
    return mod


def prepare(input, linear_weight, target, linear_bias, weight, *, weight_layout="vh",
            ignore_index=-100, empty_vocab=False) -> Prepared:
    """Check types, dtypes, devices and shapes (errors name the argument); flatten to 2-D;
    widen targets (:func:`widen_targets`). ``empty_vocab``: a vocab-parallel rank's slice,
    which may hold no class (V = 0; every other rank still waits for it in the collectives);
    its bias and class weights, where given, must then be (0,) too."""
    _require_tensor("input", input)
    _require_tensor("linear_weight", linear_weight)
    _require_tensor("target", target)
    _require_tensor("linear_bias", linear_bias, optional=True)
    _require_tensor("weight", weight, optional=True)
    for name, t in (("input", input), ("linear_weight", linear_weight),
                    ("linear_bias", linear_bias)):
        _refuse_dtensor(name, t)
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input must be a floating tensor (float32/bfloat16/float16/float64), got {input.dtype}")
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"linear_weight dtype {linear_weight.dtype} does not match input dtype {input.dtype}")
    if linear_bias is not None and linear_bias.dtype != input.dtype:
        raise TypeError(f"linear_bias dtype {linear_bias.dtype} does not match input dtype {input.dtype}")
    if target.dtype == torch.bool or target.is_floating_point() or target.is_complex():
        raise TypeError(
            f"target must hold integer class indices (e.g. torch.long), got {target.dtype}; "
            "class-probability targets are not supported")
    target = widen_targets(target, ignore_index)
    refuse_forward_ad("linear_cross_entropy", ("input", input), ("linear_weight", linear_weight),
                      ("linear_bias", linear_bias))
    if weight is not None and not weight.is_floating_point():
        raise TypeError(f"weight (class weights) must be a floating tensor, got {weight.dtype}")
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        # as F.cross_entropy: silently returning no gradient would be worse than refusing
        raise ValueError("weight (class weights) requires grad, but the loss is not "
                         "differentiable with respect to it (as in F.cross_entropy); pass "
                         "weight.detach()")
    dev = input.device
    for name, t in (("linear_weight", linear_weight), ("target", target),
                    ("linear_bias", linear_bias), ("weight", weight)):
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device} but input is on {dev}; move them to one device")
    w_shape = tuple(linear_weight.shape)
    vectors = [None if t is None else tuple(t.shape) for t in (linear_bias, weight)]
    v_dim = 0 if weight_layout == "vh" else 1
    empty = empty_vocab and len(w_shape) == 2 and w_shape[v_dim] == 0
    if empty:  # checked as a one-class slice (the spec wants V >= 1), then V set back to 0
        for name, s in (("linear_bias", vectors[0]), ("weight (class weights)", vectors[1])):
            # before the substitution below, which would take a (1,) vector for this slice
            if s is not None and s != (0,):
                raise ValueError(
                    f"{name} must have shape (V_local,) = (0,): this rank's vocabulary slice "
                    f"is empty (linear_weight has shape {w_shape}), got {s}")
        w_shape = w_shape[:v_dim] + (1,) + w_shape[v_dim + 1:]
        vectors = [None if s is None else (1,) for s in vectors]
    problem = spec.check_shapes(input.shape, w_shape, target.shape, *vectors,
                                weight_layout=weight_layout)
    if empty:
        problem = dataclasses.replace(problem, v=0)
    w = linear_weight if weight_layout == "vh" else linear_weight.t()
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    return Prepared(
        x=input.reshape(problem.n, problem.h), w=w,
        y=target.reshape(problem.n).contiguous(),  # kernels index these with stride 1
        bias=None if linear_bias is None else linear_bias.contiguous(),  # db reaches the original
        class_weight=None if weight is None else weight.detach().to(acc).contiguous(),
        problem=problem)


def check_targets(y: torch.Tensor, v: int, ignore_index: int) -> None:
    """Target range check without a host sync: an async device assert on CUDA, an
    immediate RuntimeError on CPU. Backends also never read out of bounds for bad targets."""
    if y.numel() == 0:
        return
    ok = ((y >= 0) & (y < v)) | (y == ignore_index)
    torch._assert_async(ok.all(), spec.target_range_message(v, ignore_index))


def accumulate_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """``acc += a @ b`` (``acc = a @ b`` when ``first``: no zero-fill, no read of ``acc``),
    with fp32 ``acc`` and no ``acc``-sized temporary.

    CUDA: cuBLAS with a float32 C (``out_dtype``) straight from bf16/fp16 operands. Elsewhere:
    the operands (chunk-sized) are upcast and ``addmm_`` works in place.
    """
    if a.dtype != acc.dtype and not (acc.is_cuda and acc.dtype == torch.float32):
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    kw = {} if a.dtype == acc.dtype else {"out_dtype": acc.dtype}
    if first:
        torch.mm(a, b, out=acc, **kw)
    else:
        torch.addmm(acc, a, b, out=acc, **kw)


def accumulate_rows_(acc: torch.Tensor, dz: torch.Tensor, first: bool) -> None:
    """``acc (+)= dz.sum(0)`` (the bias gradient of one chunk; assigned for the first chunk)."""
    if first:
        torch.sum(dz, 0, out=acc)
    else:
        acc += dz.sum(0)


@dataclasses.dataclass
class TokenTerms:
    """Per-token quantities of one chunk (see the spec's docstring for the symbols)."""

    lse: torch.Tensor      # lse_i
    loss: torch.Tensor     # l_i
    mask: torch.Tensor     # m_i (float)
    omega: torch.Tensor    # ω_i
    y_safe: torch.Tensor   # y_i, ignored tokens mapped to class 0


def capped_(z: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """softcap·tanh(z/softcap), in place on ``z`` (a fresh fp32/fp64 chunk of logits): no
    [C, V] temporaries beside the chunk, which ``memory_budget`` counts."""
    return z if softcap is None else z.div_(softcap).tanh_().mul_(softcap)


def logsumexp_rows(c: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(c, 1)`` with one [C, V] temporary beside ``c`` instead of two (the
    budget counts two blocks: logits and gradient). Rows of ±inf give what logsumexp gives."""
    m = c.amax(1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m + torch.sub(c, m[:, None]).exp_().sum(1).log()


def token_terms(c: torch.Tensor, y: torch.Tensor, class_weight, opts: spec.LinearCrossEntropyOptions,
                weight_sum) -> TokenTerms:
    """Loss terms from a chunk of capped logits ``c`` (fp32 or fp64, [C, V])."""
    v = c.shape[1]
    lse = logsumexp_rows(c)
    mask_b = y != opts.ignore_index
    y_safe = torch.where(mask_b, y, torch.zeros_like(y)).long()
    mask = mask_b.to(c.dtype)
    w_y = mask if class_weight is None else mask * class_weight[y_safe]
    # an ignored token reads class 0, maybe masked by a -inf bias: selected away, as 0·inf = NaN
    c_y = torch.where(mask_b, c.gather(1, y_safe[:, None])[:, 0], lse)
    loss = (1 - opts.label_smoothing) * w_y * (lse - c_y)
    if opts.uses_smoothing:
        wc = c.sum(1) if class_weight is None else c @ class_weight
        # selected, not multiplied by the mask: an ignored token's wc may be −inf (a class
        # masked by a −inf bias), and 0·inf = NaN
        loss = loss + torch.where(mask_b, (opts.label_smoothing / v) * (weight_sum * lse - wc),
                                  0.0)
    if opts.z_loss:
        loss = loss + opts.z_loss * w_y * lse * lse
    return TokenTerms(lse=lse, loss=loss, mask=mask, omega=w_y, y_safe=y_safe)


def grad_capped_logits_(c, t: TokenTerms, g_tok, h_tok, class_weight, opts, weight_sum):
    """dc = g·(A·p − B·onehot(y) − m·(ε/V)·w) + h·p for one chunk (fp32/fp64, [C, V]), times
    the softcap's derivative. Consumes ``c`` (overwritten with a softcap): one [C, V] buffer
    beside it, as ``memory_budget`` counts; out-of-place forms had used 2-2.6x the budget."""
    v = c.shape[1]
    eps = opts.label_smoothing
    # an ignored token's gradient is 0 whatever its upstream gradient (F.cross_entropy's
    # rule): selected, as g·0 would turn an inf or NaN there into NaN in every dW row
    g_tok = torch.where(t.mask != 0, g_tok, 0.0)
    p = torch.sub(c, t.lse[:, None]).exp_()
    a = (1 - eps) * t.omega + 2 * opts.z_loss * t.omega * t.lse
    if opts.uses_smoothing:
        a = a + t.mask * (eps / v) * weight_sum
    coef = g_tok * a if h_tok is None else g_tok * a + h_tok
    dc = p.mul_(coef[:, None])
    dc.scatter_add_(1, t.y_safe[:, None], (-g_tok * (1 - eps) * t.omega)[:, None])
    if opts.uses_smoothing:
        cw = torch.ones(v, dtype=c.dtype, device=c.device) if class_weight is None else class_weight
        dc.addr_(g_tok * t.mask * (eps / v), cw.to(c.dtype), alpha=-1)
    if opts.softcap is not None:  # d/dz softcap·tanh(z/softcap) = 1 − (c/softcap)²
        dc.mul_(c.div_(opts.softcap).square_().neg_().add_(1))
    return dc


def class_weight_sum(class_weight, v: int, like: torch.Tensor):
    """Ω = Σ_v w_v as a 0-d tensor (V without class weights), kept on device: no sync."""
    if class_weight is None:
        # torch.full, not torch.tensor: a host->device copy of a CPU scalar would sync
        return torch.full((), float(v), dtype=like.dtype, device=like.device)
    return class_weight.sum().to(like.dtype)


def token_weight_total(y, class_weight, ignore_index: int, dtype):
    """Σ_i ω_i over all tokens (the "mean" divisor), on device."""
    mask = y != ignore_index
    if class_weight is None:
        return mask.sum(dtype=dtype)
    y_safe = torch.where(mask, y, torch.zeros_like(y)).long()
    return (class_weight[y_safe].to(dtype) * mask).sum()


def mean_denominator(total):
    """Σω, or 1 where Σω = 0 so that an all-ignored batch gives loss 0 and zero grads."""
    return torch.where(total != 0, total, torch.ones_like(total))  # Σω < 0 divides too


# ------------------------------------------------------------------------ keyword arguments
# Keywords of the JAX front doors with no PyTorch counterpart, and what to do instead.
JAX_WEIGHT_LAYOUT = {"weight_layout": "weight_layout is a logitless.jax keyword; here weights "
                                      "are (V, H): pass an (H, V) one transposed (weight.T)"}
JAX_ONLY_KEYWORDS = {**JAX_WEIGHT_LAYOUT,
                     "axis_name": "axis_name is a logitless.jax keyword; PyTorch's vocabulary "
                                  "parallelism takes process_group="}
# linear_jsd has no vocabulary-parallel path (README): its keywords would read as typos
JSD_NOT_VOCAB_PARALLEL = {
    **{k: jsd_not_vocab_parallel(k)
       for k in ("process_group", "vocab_start_index", "vocab_size")},
    "axis_name": jsd_not_vocab_parallel("axis_name", owner="logitless.jax")}
_WARNED = set()  # (op, keyword, backend) already warned about: once per process


def check_keyword_names(op: str, given, named, tuning_names,
                        hints=JAX_ONLY_KEYWORDS) -> None:
    """TypeError, worded as Python's, for the first of ``given`` (keyword names) that is
    neither a parameter (``named``) nor any backend's tuning keyword (``tuning_names``); a
    hint names the closest one, or says what to do instead (``hints``: a JAX-only keyword, a
    module's forward() argument). Runs before any shape check, so that a misspelled keyword
    is what the error is about."""
    for k in given:
        if k not in tuning_names:
            raise unexpected_keyword(op, k, list(named) + sorted(tuning_names), hints,
                                     fallback=f"tuning keywords: {sorted(tuning_names)}")


def module_keywords(cls, forward_args, hints=JAX_ONLY_KEYWORDS):
    """(names, hints) for :func:`check_keyword_names` at a loss module's construction: its
    constructor's keyword parameters and its forward() arguments (what a misspelling is
    near), and for a forward() argument given to the constructor, where it goes."""
    init = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "tuning")]
    return tuple(init) + tuple(forward_args), {
        **hints, **{n: f"{n} is an argument of forward(), not of the constructor"
                    for n in forward_args}}


def tuning_names(backend, loaded, load, triton_fallback) -> frozenset:
    """Tuning keywords ``backend`` (a known name, or None) may take: a named backend's
    ``TUNING``, and for None (or "torch"/"triton", which one call may pick) those of both
    torch-side backends. ``loaded``/``load``: a front door's loaded backend modules and its
    loader; ``triton_fallback``: the Triton keywords where Triton cannot be imported."""
    if backend is not None and backend not in ("torch", "triton"):
        return frozenset(load(backend).TUNING)
    triton_names = loaded["triton"].TUNING if "triton" in loaded else triton_fallback
    return frozenset(loaded["torch"].TUNING) | frozenset(triton_names)


def tuning_for_backend(op: str, backend: str, accepted, tuning: dict, explicit: bool) -> dict:
    """The keywords of ``tuning`` that ``backend`` takes. Another backend's keywords are an
    error when the backend was named; with ``backend=None`` they are dropped with a warning
    (once per process), so that a GPU script (e.g. ``low_memory=True`` for Triton) runs as a
    CPU smoke test on the backend picked there."""
    extra = [k for k in tuning if k not in accepted]
    if not extra:
        return tuning
    if explicit:
        raise TypeError(f"unknown tuning keyword(s) {sorted(extra)} for backend={backend!r}; "
                        f"it accepts {list(accepted)}")
    if not torch.compiler.is_compiling():
        for k in extra:
            if (op, k, backend) not in _WARNED:
                _WARNED.add((op, k, backend))
                warnings.warn(f"{op}: backend=None picked backend={backend!r} here, which "
                              f"takes no tuning keyword {k!r}: ignored", UserWarning,
                              stacklevel=3)
    return {k: v for k, v in tuning.items() if k in accepted}
