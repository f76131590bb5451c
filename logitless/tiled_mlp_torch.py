"""Tiled MLP for PyTorch: ``tiled_mlp``, ``TiledMLP``, the ready-made ``SwiGLUMLP`` and the
fused ``swiglu`` (see :mod:`logitless.specs.tiled_mlp` for the algorithm).

Two implementations behind one entry point:

* **generic** (any ``nn.Module`` MLP): an ``autograd.Function`` whose inputs are ``x`` *and
  the module's parameters*. Forward runs the shards under ``no_grad``; backward recomputes
  each shard with *detached aliases* of the parameters swapped into the module (same storage,
  separate autograd leaves; under every name a parameter is registered under, restored after)
  and ``torch.autograd.backward(..., inputs=...)``.
  Each alias's per-shard gradient is added into an accumulator the moment it is ready (a
  post-accumulate hook), so one parameter's shard gradient exists at a time. The real
  parameters never enter the shard graphs: their gradient hooks (DDP's reducer, FSDP,
  ``register_hook``) fire once, with the summed gradient the Function returns, and autograd
  adds it to any ``.grad`` left by earlier micro-batches. Module hooks run once per shard
  (and again in the recompute), on shard-sized tensors. Autocast state is recorded in
  forward and re-entered for the recompute.
  Gradients reach only ``x`` and the registered parameters read at the call, so what would
  lose others is refused: FSDP2 sharding the MLP inside the tiled call (its hooks re-gather
  the parameters in each shard's recompute: shard the ``TiledMLP`` module or an outer module
  instead; other DTensor parameters, e.g. tensor parallelism's, take this path; a forward
  with no backward to follow, e.g. evaluation under ``no_grad``, runs as is), a hook that
  replaces a parameter requiring grad during the recompute (accelerate's offload hooks on a
  trainable weight; a frozen one, e.g. a LoRA's base weight, may be swapped), and a tensor
  requiring grad that the MLP reads but does not register (FSDP1's ``use_orig_params=False``
  flat-parameter views, a weight computed in ``forward`` from another tensor): checked once
  per call on the first shard's recompute graph.
* **fused SwiGLU** (a :class:`SwiGLUMLP` without module hooks of any kind or overridden
  forwards, on it or its projections: it never calls the modules): two
  ``torch.library`` ops. The backward recomputes only the gate/up GEMMs (the shard's output is
  never needed), writes ``h``, ``dh``, ``d gate`` and ``d up`` into two and a half shard-sized
  buffers reused for every shard, and accumulates each weight gradient *in place* with cuBLAS
  (``addmm`` into the accumulator: the parameter dtype by default; with the fp32 option, fp32
  straight from bf16 operands on CUDA): no per-shard gradient temporaries. 11 GEMMs instead
  of the generic path's 12. It runs for a plain ``SwiGLUMLP`` whose parameters match ``x``'s
  dtype and device; under autocast, ``x`` and the parameters are first cast as ``F.linear``
  would cast them (gradients reach the fp32 parameters through the casts, summed over shards
  in fp32) and the fused ops run with autocast off. Anything else takes the generic path.

``grad_accum_dtype``: the dtype in which half-precision parameter gradients are summed over
shards. ``None`` (default) sums in each parameter's dtype, as PyTorch does across
micro-batches and as peers' tiled MLPs do: one rounding per shard, no extra memory.
``torch.float32`` sums in fp32, at the cost of fp32 accumulators, 2 bytes per parameter more
than the gradients themselves (352 MB for a Llama-3-8B layer). On the fused path the GEMMs
accumulate straight into them, so the result is rounded once (errors below the untiled
MLP's). On the generic path autograd has already rounded each shard's gradient to the
parameter dtype: the fp32 sum over shards removes the running sum's roundings, not each
shard's, so the errors stay those of one rounding per shard. One shard needs no accumulator.
Nothing here synchronizes with the host: the shard plan depends on shapes only.
The MLP must be position-wise. Backward recomputes it from the forward's RNG state (CPU, and
CUDA for ``x``'s device), restored as ``torch.utils.checkpoint`` does, so dropout masks match.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import _torch_common as common
from .specs import tiled_mlp as spec

try:  # the Triton SwiGLU (CUDA, or the interpreter); the torch formula below otherwise
    from .triton_kernels import swiglu as _triton_swiglu
except ImportError:  # no Triton installed
    _triton_swiglu = None

__all__ = ["tiled_mlp", "TiledMLP", "SwiGLUMLP", "swiglu"]

HALF_DTYPES = (torch.bfloat16, torch.float16)
# The fused backward holds gate and up of a whole shard; its third buffer (h, then dh, for the
# down projection's weight gradient and for dh) covers 1/SCRATCH_SPLIT of the shard, those
# two GEMMs running per part: 2.5 instead of 3 [shard, I] buffers, GEMMs still large.
SCRATCH_SPLIT = 2


# ----------------------------------------------------------------------------- SwiGLU
def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _swiglu_forward_torch(gate, up, out=None):
    """The Triton kernel's math in torch ops: fp32 (fp64 for fp64), one rounding."""
    g = gate.to(_compute_dtype(gate.dtype))
    h = F.silu(g).mul_(up.to(g.dtype))
    return h.to(gate.dtype) if out is None else out.copy_(h)


def _swiglu_backward_torch(grad_h, gate, up, *, grad_gate=None, grad_up=None):
    g = gate.to(_compute_dtype(gate.dtype))
    dh = grad_h.to(g.dtype)
    s = torch.sigmoid(g)
    silu = g * s
    dg = dh * up.to(g.dtype) * (s + silu * (1.0 - s))
    du = dh * silu  # not in place: dh may be the caller's grad_h itself (fp32/fp64)
    dg = dg.to(gate.dtype) if grad_gate is None else grad_gate.copy_(dg)
    du = du.to(gate.dtype) if grad_up is None else grad_up.copy_(du)
    return dg, du


def _use_triton(t: torch.Tensor) -> bool:
    return (_triton_swiglu is not None and t.dtype in _triton_swiglu.SUPPORTED_DTYPES
            and (common.triton_gpu(t.device) or _triton_swiglu.interpreted()))


def _swiglu_kernels(t: torch.Tensor):
    """(forward, backward) launchers for tensors like ``t``: Triton where it runs, else torch."""
    if _use_triton(t):
        return _triton_swiglu.swiglu_forward, _triton_swiglu.swiglu_backward
    return _swiglu_forward_torch, _swiglu_backward_torch


class _SwiGLUTorch(torch.autograd.Function):
    """The torch-formula SwiGLU with the kernel's memory use: saves only gate and up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _swiglu_forward_torch(gate, up)

    @staticmethod
    def backward(ctx, grad_h):
        gate, up = ctx.saved_tensors
        return _swiglu_backward_torch(grad_h, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, differentiable, computed in fp32 and rounded once to the inputs'
    dtype. The Triton kernel (``logitless::swiglu``) on CUDA, the same math in torch ops
    elsewhere; only ``gate`` and ``up`` are saved for backward."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dimension")
    if up.shape != gate.shape:
        raise ValueError(f"up has shape {list(up.shape)} but gate has {list(gate.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up dtype {up.dtype} does not match gate dtype {gate.dtype}")
    if up.device != gate.device:
        raise ValueError(f"up is on {up.device} but gate is on {gate.device}")
    common.refuse_forward_ad("swiglu", ("gate", gate), ("up", up))
    if _use_triton(gate):
        return _triton_swiglu.swiglu(gate, up)
    return _SwiGLUTorch.apply(gate, up)


class SwiGLUMLP(nn.Module):
    """Llama's MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the fused SwiGLU.

    Parameter names and layouts are those of Hugging Face's ``LlamaMLP`` (``gate_proj``,
    ``up_proj``: ``[intermediate, hidden]``; ``down_proj``: ``[hidden, intermediate]``), so
    its state dict loads as is. Wrapped in :class:`TiledMLP` (or passed to
    :func:`tiled_mlp`) it runs the fused tiled path.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"bias={self.gate_proj.bias is not None}")


# ----------------------------------------------------------------------------- fused tiled SwiGLU
def _linear_into(x, w, b, out):
    """out = x·wᵀ (+ b) through cuBLAS, in place."""
    if b is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


def _accum_dtype(p: torch.Tensor, accum_fp32: bool, num_shards: int):
    return torch.float32 if (accum_fp32 and num_shards > 1 and p.dtype in HALF_DTYPES) else p.dtype


def _sum_tokens_(acc, t, first):
    """acc (+)= Σ_tokens t, summed in acc's dtype."""
    if first:
        torch.sum(t, 0, dtype=acc.dtype, out=acc)
    else:
        acc += t.sum(0, dtype=acc.dtype)


@torch.library.custom_op("logitless::tiled_swiglu_mlp", mutates_args=())
def _tiled_swiglu_fwd(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      w_down: torch.Tensor, b_gate: Optional[torch.Tensor],
                      b_up: Optional[torch.Tensor], b_down: Optional[torch.Tensor],
                      shard: int, accum_fp32: bool) -> torch.Tensor:
    """``y (N, H_out)`` for ``x (N, H)``, shard by shard; keeps nothing. (``accum_fp32`` is
    for the backward.)"""
    n = x.shape[0]
    y = torch.empty(n, w_down.shape[0], dtype=x.dtype, device=x.device)
    plan = spec.ShardPlan(n=n, shard=shard)
    if n == 0:
        return y
    fwd, _ = _swiglu_kernels(x)
    rows = min(shard, n)
    gbuf = torch.empty(rows, w_gate.shape[0], dtype=x.dtype, device=x.device)
    ubuf = torch.empty_like(gbuf)
    with common.on_device(x):  # the Triton SwiGLU launches on the current device's stream
        for s, e in plan.bounds():
            g, u = gbuf[: e - s], ubuf[: e - s]
            _linear_into(x[s:e], w_gate, b_gate, g)
            _linear_into(x[s:e], w_up, b_up, u)
            fwd(g, u, out=g)  # h over g
            _linear_into(g, w_down, b_down, y[s:e])
    return y


@_tiled_swiglu_fwd.register_fake
def _(x, w_gate, w_up, w_down, b_gate, b_up, b_down, shard, accum_fp32):
    return x.new_empty(x.shape[0], w_down.shape[0])


@torch.library.custom_op("logitless::tiled_swiglu_mlp_backward", mutates_args=())
def _tiled_swiglu_bwd(dy: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor,
                      w_up: torch.Tensor, w_down: torch.Tensor, b_gate: Optional[torch.Tensor],
                      b_up: Optional[torch.Tensor], b_down: Optional[torch.Tensor], shard: int,
                      needs: List[bool], accum_fp32: bool) -> List[torch.Tensor]:
    """Gradients of ``(x, w_gate, w_up, w_down, b_gate, b_up, b_down)`` (an empty tensor for
    each one not in ``needs``), recomputing gate and up per shard."""
    n = x.shape[0]
    plan = spec.ShardPlan(n=n, shard=shard)
    params = (w_gate, w_up, w_down, b_gate, b_up, b_down)
    needs = [bool(f) and (i == 0 or params[i - 1] is not None) for i, f in enumerate(needs)]
    if n == 0 or not any(needs):
        return [x.new_zeros(t.shape) if f else x.new_empty(0)
                for f, t in zip(needs, (x,) + params)]
    acc = [None if not f else torch.empty(p.shape, device=p.device,
                                          dtype=_accum_dtype(p, accum_fp32, plan.num_shards))
           for f, p in zip(needs[1:], params)]
    dx = torch.empty_like(x) if needs[0] else None
    with common.on_device(x):  # as in the forward
        _backward_sweep(plan, dy, x, params, acc, dx)  # its shard buffers are gone on return
    out = [x.new_empty(0) if dx is None else dx]
    for j, p in enumerate(params):  # the fp32 accumulators, cast and freed one at a time
        a, acc[j] = acc[j], None
        out.append(x.new_empty(0) if a is None else a if a.dtype == p.dtype else a.to(p.dtype))
        del a
    return out


def _backward_sweep(plan, dy, x, params, acc, dx):
    """The shard loop of the fused backward: accumulates into ``acc`` (one tensor or None per
    parameter) and writes ``dx`` (or None)."""
    w_gate, w_up, w_down, b_gate, b_up, b_down = params
    dwg, dwu, dwd, dbg, dbu, dbd = acc
    need_dh = any(a is not None for a in (dx, dwg, dwu, dbg, dbu))  # anything behind the SwiGLU
    fwd, bwd = _swiglu_kernels(x)
    rows = min(plan.shard, plan.n)
    gbuf = torch.empty(rows, w_gate.shape[0], dtype=x.dtype, device=x.device)
    ubuf = torch.empty_like(gbuf)
    half = -(-rows // SCRATCH_SPLIT)
    hbuf = torch.empty(half, w_gate.shape[0], dtype=x.dtype, device=x.device)
    for i, (s, e) in enumerate(plan.bounds()):
        first = i == 0
        xs, dys = x[s:e], dy[s:e]
        g, u = gbuf[: e - s], ubuf[: e - s]
        _linear_into(xs, w_gate, b_gate, g)
        _linear_into(xs, w_up, b_up, u)
        for j, t0 in enumerate(range(0, e - s, half) if (dwd is not None or need_dh) else ()):
            t1 = min(t0 + half, e - s)
            gt, ut, dyt, h = g[t0:t1], u[t0:t1], dys[t0:t1], hbuf[: t1 - t0]
            if dwd is not None:
                fwd(gt, ut, out=h)
                common.accumulate_mm_(dwd, dyt.t(), h, first=first and j == 0)
            if need_dh:
                torch.mm(dyt, w_down, out=h)            # dh (h is no longer needed)
                bwd(h, gt, ut, grad_gate=gt, grad_up=ut)  # d gate over g, d up over u
        if dbd is not None:
            _sum_tokens_(dbd, dys, first)
        if not need_dh:
            continue
        if dwg is not None:
            common.accumulate_mm_(dwg, g.t(), xs, first=first)
        if dwu is not None:
            common.accumulate_mm_(dwu, u.t(), xs, first=first)
        if dbg is not None:
            _sum_tokens_(dbg, g, first)
        if dbu is not None:
            _sum_tokens_(dbu, u, first)
        if dx is not None:
            torch.mm(g, w_gate, out=dx[s:e])
            torch.addmm(dx[s:e], u, w_up, out=dx[s:e])


@_tiled_swiglu_bwd.register_fake
def _(dy, x, w_gate, w_up, w_down, b_gate, b_up, b_down, shard, needs, accum_fp32):
    params = (w_gate, w_up, w_down, b_gate, b_up, b_down)
    out = [x.new_empty(x.shape) if needs[0] else x.new_empty(0)]
    for f, p in zip(needs[1:], params):
        out.append(p.new_empty(p.shape) if (f and p is not None) else x.new_empty(0))
    return out


def _fused_setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, b_gate, b_up, b_down, shard, accum_fp32 = inputs
    ctx.save_for_backward(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    ctx.shard, ctx.accum_fp32 = shard, accum_fp32


# create_graph=True: the recompute's gradients are summed outside any graph
NO_DOUBLE_BACKWARD = (
    "tiled_mlp has no double backward (create_graph=True): its backward recomputes the MLP "
    "shard by shard and returns summed gradients that are not themselves differentiable. For "
    "a penalty on the gradient, call the MLP untiled.")


def _fused_backward(ctx, dy):
    if torch.is_grad_enabled():
        raise RuntimeError(NO_DOUBLE_BACKWARD)
    saved = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:7])
    grads = _tiled_swiglu_bwd(dy.contiguous(), *saved, ctx.shard, needs, ctx.accum_fp32)
    return tuple(g if f else None for g, f in zip(grads, needs)) + (None, None)


_tiled_swiglu_fwd.register_autograd(_fused_backward, setup_context=_fused_setup_context)


def _runs_class_forward_only(m: nn.Module, cls) -> bool:
    """Calling ``m`` runs ``cls.forward`` and nothing else: no subclass or instance-level
    forward (accelerate's ``add_hook_to_module`` sets one on the instance) and no hooks of any
    kind, forward or backward. The fused path never calls the modules, so it would skip them."""
    return (type(m).forward is cls.forward and "forward" not in vars(m)
            and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                     or m._backward_pre_hooks))


def _fused_swiglu_parts(mlp) -> Optional[tuple]:
    """The weights of a plain :class:`SwiGLUMLP` (no hooks, no overridden forward), or None."""
    if not _runs_class_forward_only(mlp, SwiGLUMLP):
        return None
    lins = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(_runs_class_forward_only(m, nn.Linear) for m in lins):
        return None
    return tuple(m.weight for m in lins) + tuple(m.bias for m in lins)


_FUSED_NAMES = tuple(f"{m}_proj.{p}" for p in ("weight", "bias") for m in ("gate", "up", "down"))

SHARD_OUTSIDE = ("shard the TiledMLP module or an outer module, not the MLP inside the tiled "
                 "call")


def _refuse_fsdp2(mlp: nn.Module) -> None:
    """TypeError if FSDP2's ``fully_shard`` manages the MLP or a module inside it. The tiled
    call reads the parameters before any of the MLP's hooks run: there these are the sharded
    DTensors, and FSDP2's pre-forward hook installs the gathered ones in every shard's
    recompute, where no gradient of the tiled backward reaches them. (Other DTensor
    parameters, e.g. tensor parallelism's, stay in place and take the generic path.) Called
    only when a backward can follow: a forward alone (evaluation under ``no_grad``, or nothing
    requiring grad) runs the shards through FSDP2's hooks, which gather the weights, and
    equals ``mlp(x)``."""
    for name, m in mlp.named_modules():
        # by class name: fully_shard makes the module's class a subclass of FSDPModule, and
        # torch.distributed need not be importable
        if any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
            where = "the MLP" if not name else f"the MLP's submodule {name!r}"
            raise TypeError(
                f"tiled_mlp: {where} is sharded by FSDP2's fully_shard inside the tiled call: "
                f"{SHARD_OUTSIDE} (e.g. fully_shard(block) with the tiled call in "
                "block.forward), where FSDP2 hands the tiled call plain tensors. Sharding the "
                "MLP itself would re-gather its parameters in each shard's recompute, out of "
                "reach of the tiled backward: their gradients would be lost.")


# ----------------------------------------------------------------------------- generic path
class _GenericRun:
    """Static configuration of one generic tiled call (held by the autograd context)."""

    def __init__(self, mlp, names, plan, x_shape, accum_fp32, autocast):
        self.mlp, self.names, self.plan = mlp, names, plan
        self.x_shape, self.accum_fp32, self.autocast = tuple(x_shape), accum_fp32, autocast
        self.rng = None  # (CPU state, CUDA state or None) at the forward's first shard

    def shard_view(self, x2, s, e):
        return x2[s:e].view(spec.shard_shape(self.x_shape, e - s))

    def forward(self, x):
        # as torch.utils.checkpoint: the recompute replays the forward's random draws
        # (dropout masks) from the same RNG state, shard after shard in the same order
        self.rng = (torch.get_rng_state(),
                    torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        x2 = x.reshape(self.plan.n, self.x_shape[-1])
        y2 = None
        for s, e in self.plan.bounds():
            ys = _check_output(self.mlp(self.shard_view(x2, s, e)), self.x_shape, e - s)
            if y2 is None:
                y2 = ys.new_empty(self.plan.n, ys.shape[-1])
            y2[s:e] = ys.reshape(e - s, -1)
        if y2 is None:  # no tokens: the output's width comes from a trial on an empty shard
            ys = _check_output(self.mlp(self.shard_view(x2, 0, 0)), self.x_shape, 0)
            y2 = ys.new_empty(0, ys.shape[-1])
        return y2.view(self.x_shape[:-1] + (y2.shape[-1],))

    def backward(self, x, params, dy, need_x, need_params):
        x2 = x.detach().reshape(self.plan.n, self.x_shape[-1])
        dy2 = dy.reshape(self.plan.n, dy.shape[-1])
        k = self.plan.num_shards
        acc = [None] * len(params)
        aliases = {}
        for i, (name, p, need) in enumerate(zip(self.names, params, need_params)):
            alias = p.detach().requires_grad_(need)
            if need:
                alias.register_post_accumulate_grad_hook(self._accumulator(acc, i, p, k))
            aliases[name] = alias
        wanted = [aliases[n] for n, need in zip(self.names, need_params) if need]
        alias_of = {id(self.mlp.get_parameter(n)): a for n, a in aliases.items()}
        dx2 = torch.empty_like(x2) if need_x else None
        dev = x.device.type
        cpu_rng, cuda_rng = self.rng
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []), \
                _parameters_swapped(self.mlp, alias_of) as swapped, \
                torch.enable_grad(), torch.autocast(dev, enabled=self.autocast[0],
                                                    dtype=self.autocast[1]):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, x.device)
            # no tokens: one empty shard, so that parameters get zero gradients as autograd
            # through the untiled module gives them (None only for ones the MLP never uses)
            for i, (s, e) in enumerate(list(self.plan.bounds()) or [(0, 0)]):
                xs = self.shard_view(x2, s, e).detach().requires_grad_(need_x)
                ys = self.mlp(xs)
                _check_still_swapped(swapped, alias_of)
                if i == 0 and ys.grad_fn is not None:  # the graph is the same for every shard
                    _check_no_foreign_leaf(ys.grad_fn, [xs] + wanted)
                inputs = ([xs] if need_x else []) + wanted
                if ys.requires_grad:
                    torch.autograd.backward(ys, dy2[s:e].view(ys.shape), inputs=inputs)
                if need_x:
                    if xs.grad is None:
                        dx2[s:e].zero_()
                    else:
                        dx2[s:e] = xs.grad.reshape(e - s, x2.shape[1])
        grads = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return (None if dx2 is None else dx2.view(x.shape)), grads

    def _accumulator(self, acc, i, p, k):
        wide = _accum_dtype(p, self.accum_fp32, k)

        def hook(alias):
            g, alias.grad = alias.grad, None
            if acc[i] is None:
                acc[i] = g if g.dtype == wide else g.to(wide)
            else:
                acc[i].add_(g)
        return hook


@contextlib.contextmanager
def _parameters_swapped(mlp: nn.Module, alias_of: dict):
    """``mlp``'s parameters replaced by their aliases (``alias_of[id(parameter)]``) under every
    name they are registered under, and put back after. By hand rather than through
    ``torch.func.functional_call``: with one submodule registered under two names
    (``self.b = self.a``), functional_call (torch 2.13) left the alias in place, and the real
    Parameter never received a gradient again."""
    swapped = [(m, name, p) for m in mlp.modules() for name, p in m._parameters.items()
               if p is not None and id(p) in alias_of]
    try:
        for m, name, p in swapped:
            m._parameters[name] = alias_of[id(p)]
        yield swapped
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p


def _check_still_swapped(swapped, alias_of):
    """RuntimeError if a hook replaced an alias requiring grad while the MLP ran (FSDP2 on the
    MLP itself, accelerate's offload hooks): the recompute then used a tensor whose gradient
    the tiled backward never collects. A frozen parameter's replacement loses nothing (e.g.
    an offloaded frozen base weight under LoRA adapters), so it is let be."""
    for m, name, p in swapped:
        alias = alias_of[id(p)]
        if alias.requires_grad and m._parameters.get(name) is not alias:
            raise RuntimeError(
                f"tiled_mlp: a hook replaced the parameter {name!r} of {type(m).__name__} while "
                "the MLP was recomputed in backward (e.g. FSDP2's fully_shard or accelerate's "
                "offload hooks on the MLP inside the tiled call); its gradient would be lost. "
                f"Hooks that install parameters must sit outside the tiled call: "
                f"{SHARD_OUTSIDE}.")


def _check_no_foreign_leaf(root, allowed):
    """RuntimeError if the recompute's graph (from ``root``, an output's grad_fn) reaches a
    leaf requiring grad other than ``allowed`` (the shard input and the parameter aliases):
    the MLP read a tensor that is not a registered parameter, whose gradient the tiled
    backward (``inputs=``) would drop. Depth-first, stopping at the first such leaf, so a
    graph outside the MLP is walked only as far as its first leaf."""
    ok = {id(t) for t in allowed}
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if leaf is None:
            stack.extend(f for f, _ in node.next_functions)
        elif id(leaf) not in ok:
            kind = "nn.Parameter" if isinstance(leaf, nn.Parameter) else "tensor"
            raise RuntimeError(
                "tiled_mlp: the MLP's forward reads a tensor that requires grad but is neither "
                "x nor a parameter registered in the MLP (its gradient reaches a leaf "
                f"{kind} of shape {list(leaf.shape)}, {leaf.dtype}), e.g. a weight computed "
                "in forward from another tensor, a tensor attribute, another module's "
                "parameter, FSDP1's use_orig_params=False flat-parameter views. The tiled "
                "backward returns gradients only for x and the MLP's registered parameters: "
                "that one would be lost. Register it as an nn.Parameter of the MLP (with FSDP: "
                "FSDP2's fully_shard on the TiledMLP module or an outer module), or call the "
                "MLP untiled.")


def _check_output(ys, x_shape, tokens):
    if not isinstance(ys, torch.Tensor):
        raise TypeError(f"the MLP must return one tensor, got {type(ys).__name__}")
    want = spec.shard_shape(x_shape, tokens)[:-1]
    if tuple(ys.shape[:-1]) != want:
        raise ValueError(f"the MLP must be position-wise: a shard of shape "
                         f"{list(want) + [x_shape[-1]]} gave an output of shape {list(ys.shape)}")
    return ys


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _GenericRun, x, *params):
        ctx.run = run
        ctx.save_for_backward(x, *params)
        return run.forward(x)

    @staticmethod
    def backward(ctx, dy):
        # (once_differentiable errs only when dy requires grad; loss.backward()'s does not)
        if torch.is_grad_enabled():
            raise RuntimeError(NO_DOUBLE_BACKWARD)
        x, *params = ctx.saved_tensors
        dx, grads = ctx.run.backward(x, params, dy, ctx.needs_input_grad[1],
                                     ctx.needs_input_grad[2:])
        return (None, dx, *grads)


# ----------------------------------------------------------------------------- entry points
def _check_accum(grad_accum_dtype):
    if grad_accum_dtype is not None and grad_accum_dtype != torch.float32:
        raise ValueError("grad_accum_dtype must be torch.float32 or None (each parameter's own "
                         f"dtype), got {grad_accum_dtype!r}")
    return grad_accum_dtype is not None


def tiled_mlp(mlp: nn.Module, x: torch.Tensor, *, num_shards: Optional[int] = None,
              grad_accum_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``mlp(x)`` computed shard by shard over the tokens, recomputed in backward.

    Args:
        mlp: a position-wise ``nn.Module`` (``[..., n, H] -> [..., n, H_out]``). A
            :class:`SwiGLUMLP` runs the fused path; anything else the generic one, whose
            backward recomputes it under the forward's RNG state (dropout masks match).
        x: ``[..., T, H]`` (e.g. ``[B, T, H]`` or ``[T, H]``). The ``B·T`` tokens are split
            into ``num_shards`` shards of ``ceil(B·T / num_shards)`` consecutive tokens (the
            last one shorter); the MLP sees each as ``[1, …, 1, n, H]``.
        num_shards: default ``ceil(T / H)``.
        grad_accum_dtype: ``None`` (default) sums parameter gradients over shards in each
            parameter's dtype; ``torch.float32`` sums half-precision ones in fp32 (2 more
            bytes per parameter while backward runs). On the fused path that rounds once; on
            the generic path each shard's gradient is still rounded to the parameter dtype
            by autograd, and only the sum over shards is made in fp32.

    Returns:
        ``[..., T, H_out]``. Each parameter's gradient reaches autograd once per backward.

    Forward-mode AD (``torch.func.jvp``) is refused: backward is reverse mode only; so is a
    double backward (``create_graph=True``). Refused too, since their gradients would be
    lost: FSDP2 sharding the MLP or a module inside it when a backward can follow
    (``TypeError``; shard the ``TiledMLP`` module or an outer one instead) and, on the generic
    path, a parameter requiring grad that a hook replaces during the recompute or a tensor
    requiring grad that the MLP reads without registering it as a parameter
    (``RuntimeError`` in backward, before any gradient lands).
    """
    if not isinstance(mlp, nn.Module):
        raise TypeError(f"mlp must be a torch.nn.Module, got {type(mlp).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {x.dtype}")
    plan = spec.plan_shards(x.shape, num_shards)
    accum_fp32 = _check_accum(grad_accum_dtype)
    common.refuse_forward_ad("tiled_mlp", ("x", x))
    dev = x.device.type
    autocast = torch.is_autocast_enabled(dev)
    if torch.is_grad_enabled() and (x.requires_grad or
                                    any(p.requires_grad for p in mlp.parameters())):
        _refuse_fsdp2(mlp)  # without a backward to follow (evaluation), FSDP2 works as is
    parts = _fused_swiglu_parts(mlp)
    if parts is not None and any(map(common.is_dtensor, parts)):  # the fused ops take plain tensors
        parts = None
    if parts is not None:
        common.refuse_forward_ad("tiled_mlp", *zip(_FUSED_NAMES, parts))
        # under autocast, as nn.Linear would see them (a no-op outside autocast)
        xf, *cast = common.autocast_inputs(x, *parts)
        # parameters cast down by autocast (fp32 masters) sum their shard gradients in fp32:
        # "each parameter's dtype", and one rounding as the untiled autocast MLP has
        wide = any(p is not None and c.dtype != p.dtype for p, c in zip(parts, cast))
        if all(p is None or (p.dtype == xf.dtype and p.device == xf.device) for p in cast):
            with common.autocast_off(xf.device):
                y2 = _tiled_swiglu_fwd(xf.reshape(plan.n, x.shape[-1]), *cast, plan.shard,
                                       accum_fp32 or wide)
            return y2.view(x.shape[:-1] + (y2.shape[-1],))
    named = list(mlp.named_parameters())
    run = _GenericRun(mlp, [n for n, _ in named], plan, x.shape, accum_fp32,
                      (autocast, torch.get_autocast_dtype(dev) if autocast else None))
    return _TiledFunction.apply(run, x, *(p for _, p in named))


class TiledMLP(nn.Module):
    """Module form of :func:`tiled_mlp`: ``TiledMLP(mlp)(x) == tiled_mlp(mlp, x)``. The wrapped
    module is the submodule ``mlp`` (its parameters are this module's, under ``mlp.``)."""

    def __init__(self, mlp: nn.Module, num_shards: Optional[int] = None, *,
                 grad_accum_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not isinstance(mlp, nn.Module):
            raise TypeError(f"mlp must be a torch.nn.Module, got {type(mlp).__name__}")
        if num_shards is not None:
            spec.plan_shards((1, 1), num_shards)  # validates it
        _check_accum(grad_accum_dtype)
        self.mlp, self.num_shards, self.grad_accum_dtype = mlp, num_shards, grad_accum_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(self.mlp, x, num_shards=self.num_shards,
                         grad_accum_dtype=self.grad_accum_dtype)

    def extra_repr(self):
        return f"num_shards={self.num_shards}, grad_accum_dtype={self.grad_accum_dtype}"
