"""What the Pallas row kernels (linear cross-entropy, linear JSD) share around their math:
resolving the launch settings from the tuning keywords, the tile and grid of one call, the
``pallas_call`` itself, and the persistent walk over row blocks inside a kernel."""
from __future__ import annotations

import types
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import _jax_common as common
from ..specs.tiling import ceil_div, next_power_of_2

# Index math in int32 whatever jax_enable_x64 says (offsets into buffers past 2**32 bytes are
# widened by Pallas itself); loop counters, iotas and program ids then share one type.
I0 = np.int32(0)


def iota(n):
    return jnp.arange(n, dtype=jnp.int32)


def pick(defaults: Dict[str, Any], value, key: str):
    """``value``, or the GPU default ``defaults[key]`` when it is None."""
    return defaults[key] if value is None else value


def sm_count() -> Optional[int]:
    """The default device's SMs (None where it has no core count: a CPU)."""
    sms = getattr(jax.devices()[0], "core_count", None)
    return int(sms) if sms else None


def default_grid_size(defaults: Dict[str, Any]) -> Optional[int]:
    """SMs × ``defaults["programs_per_sm"]`` (None where the device has no core count)."""
    sms = sm_count()
    return None if sms is None else sms * defaults["programs_per_sm"]


def resolve_interpret(interpret) -> bool:
    """``interpret`` checked; None: True off a GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool or None, got {interpret!r}")
    return interpret


def resolve(defaults: Dict[str, Any], *, block_rows, block_v, num_warps, num_stages,
            fp32_logits, interpret) -> Dict[str, Any]:
    """The kernel's launch settings (the head's fields of those names), checked, with the GPU
    ``defaults`` for those not given; ``interpret`` defaults to True off a GPU."""
    interpret = resolve_interpret(interpret)
    if not isinstance(fp32_logits, bool):
        raise TypeError(f"fp32_logits must be a bool, got {fp32_logits!r}")
    return dict(
        block_rows=common.check_tuning("block_rows", pick(defaults, block_rows, "block_rows"),
                                       power_of_2=True, hi=1024),
        block_v=common.check_tuning("block_v", pick(defaults, block_v, "block_v"),
                                    power_of_2=True, hi=1 << 16),
        num_warps=common.check_tuning("num_warps", pick(defaults, num_warps, "num_warps"),
                                      power_of_2=True, hi=32),
        num_stages=common.check_tuning("num_stages", pick(defaults, num_stages, "num_stages"),
                                       hi=8),
        interpret=interpret, fp32_logits=fp32_logits)


def resolve_grid(defaults: Dict[str, Any], grid_size, interpret: bool) -> Optional[int]:
    """A persistent kernel's program count: ``grid_size`` checked, else SMs ×
    ``defaults["programs_per_sm"]`` on a GPU, else None (one program per row block)."""
    if grid_size is not None:
        return common.check_tuning("grid_size", grid_size)
    return None if interpret else default_grid_size(defaults)


def block_shape(head, n_rows: int, v: int):
    """``(block_rows, block_v)`` of one call on ``[n_rows, v]`` logits: the head's tile shrunk
    to the buffer."""
    return min(head.block_rows, next_power_of_2(n_rows)), min(head.block_v, next_power_of_2(v))


def tile(head, n_rows: int, v: int):
    """``(block_rows, block_v, grid_size)`` of one call of a persistent kernel: the head's tile
    shrunk to the buffer, at most one program per row block."""
    block_rows, block_v = block_shape(head, n_rows, v)
    n_row_blocks = ceil_div(n_rows, block_rows)
    grid_size = n_row_blocks if head.grid_size is None else min(head.grid_size, n_row_blocks)
    return block_rows, block_v, grid_size


def check_interpret_x64(head, write_grad: bool) -> None:
    """A clear error instead of JAX's own: interpreted (off a GPU) under ``jax_enable_x64``,
    Pallas (jax 0.10) discharges the gradient sweep's masked stores inside a loop with int32
    and int64 indices mixed, and fails with "index arguments to dynamic_slice must be
    integers of the same type". The loss alone (no gradient) runs."""
    if write_grad and head.interpret and \
            jax.dtypes.canonicalize_dtype(jnp.int64) == jnp.dtype(jnp.int64):
        raise NotImplementedError(
            "backend='pallas' in interpret mode (off a GPU) cannot differentiate with "
            "jax_enable_x64 on (a Pallas interpreter limitation); use backend='xla' there")


def typed_call(kernel, inputs, out_shape, *, interpret: bool, name: str, **params):
    """``pl.pallas_call(kernel, out_shape=..., interpret=..., name=..., **params)(*inputs)``
    for any trace it may meet:

    * inside ``shard_map`` (check_vma=True) Pallas needs each output's varying mesh axes: the
      inputs are cast to vary over the union of theirs and the outputs get that type;
    * the first-order gradients never differentiate a kernel (the ops' custom VJPs call the
      kernels in their rules); only second-order derivatives (``jax.hessian``, grad of grad)
      do, where Pallas' own JVP fails ("JVP with aliasing not supported", or a bare
      AssertionError): a JVP rule that raises a clear error instead.
    """
    inputs = common.match_varying(*inputs)
    axes = common.varying_axes(inputs[0]) if inputs else frozenset()
    if interpret and axes:
        # JAX's own interpreter (jax 0.10, 0.11) pads the varying inputs with invariant
        # values and fails when lowered ("Primitive pad requires varying manual axes to match")
        raise NotImplementedError(
            f"{name}: backend='pallas' in interpret mode (off a GPU) cannot run inside "
            "jax.shard_map with check_vma=True (the default) on values that vary over mesh "
            f"axes {sorted(axes, key=str)}: a Pallas interpreter limitation; use "
            "backend='xla' there, or shard_map(..., check_vma=False)")
    mat = getattr(jax.typeof(inputs[0]), "manual_axis_type", None) if inputs else None
    if mat is not None:
        out_shape = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape)

    @jax.custom_jvp
    def run(*args):
        return pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret, name=name,
                              **params)(*args)

    @run.defjvp
    def _no_jvp(primals, tangents):
        raise NotImplementedError(
            f"{name}: backend='pallas' has no second-order derivatives (jax.hessian, grad of "
            "grad, jvp of a gradient): its kernels have no JVP rule; use backend='xla'")

    return run(*inputs)


def _ptx(instruction: str, x):
    x = x.astype(jnp.float32)
    return plgpu.elementwise_inline_asm(
        f"{instruction} $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def ptx_math(exp_ftz: bool = True) -> types.SimpleNamespace:
    """exp / log as Triton's tl.exp / tl.log compile them: ex2.approx / lg2.approx (one MUFU
    instruction, ~2 ulp) after a multiply, where Pallas would call libdevice's expf / logf.
    See ``_jax_common.kernel_math``; the Triton kernels' accuracy rests on the same forms.
    ``exp_ftz``: ``ex2.approx.ftz``, the bare MUFU.EX2; ptxas wraps the plain form in a
    compare and two predicated multiplies that keep results under 2^-126 subnormal, which no
    exponential of these kernels needs (``triton_kernels/fast_math.py``). The log keeps them:
    a flushed subnormal argument would turn a finite log into -inf."""
    ex2 = "ex2.approx.ftz.f32" if exp_ftz else "ex2.approx.f32"
    return types.SimpleNamespace(
        exp=lambda x: _ptx(ex2, x * np.float32(1.4426950408889634)),
        log=lambda x: _ptx("lg2.approx.f32", x) * np.float32(0.6931471805599453))


PTX_MATH = ptx_math()


def _with_ptx_math(kernel):
    def traced(*refs):
        with common.kernel_math(PTX_MATH):
            return kernel(*refs)
    return traced


def call(head, kernel, inputs, out_shape, *, grid: tuple, aliases, name: str):
    """``pallas_call`` of ``kernel`` on ``grid`` with the head's Triton settings; on a GPU the
    body's ``_jax_common.exp`` / ``log`` are ``PTX_MATH``'s (interpret mode: jnp's)."""
    if not head.interpret:
        kernel = _with_ptx_math(kernel)
    return typed_call(kernel, inputs, out_shape, grid=grid, input_output_aliases=aliases,
                      interpret=head.interpret, name=name,
                      compiler_params=plgpu.CompilerParams(num_warps=head.num_warps,
                                                           num_stages=head.num_stages))


def store_grad_backwards(dz_ref, rows, rmask, v: int, block_v: int, grad_block,
                         blocks=None, evict=None) -> None:
    """Inside a kernel, the gradient sweep of a row block: ``grad_block(j) -> (dz, cmask,
    span)`` for column blocks j of ``block_v`` columns from the last to the first (the previous
    sweep read the last ones last), each stored in ``dz_ref``'s dtype over the whole width of
    ``dz_ref``. Where that is wider than the vocabulary ``v`` (the padded classes of
    ``_jax_common.VocabWeight``), the columns past ``v`` (``cmask`` false) get 0. ``blocks``:
    (first, end) of the blocks to sweep (may be traced; default all of them); ``evict``: the
    stores' L2 eviction policy."""
    width = dz_ref.shape[1]
    first, end = blocks if blocks is not None else (I0, np.int32(ceil_div(width, block_v)))

    def sweep(t, carry):
        j = end - 1 - t
        dz, cmask, span = grad_block(j)
        if width > v:
            dz = jnp.where(cmask[None, :], dz, 0.0)
            cmask = (j * block_v + iota(block_v)) < width
        plgpu.store(dz_ref.at[rows, span], dz.astype(dz_ref.dtype),
                    mask=rmask[:, None] & cmask[None, :], eviction_policy=evict)
        return carry

    lax.fori_loop(I0, end - first, sweep, 0)


def walk_row_blocks(row_block, n_rows: int, block_rows: int, grid_size: int) -> None:
    """Inside a kernel: program p runs ``row_block(r0)`` for row blocks p, p + grid_size, ..."""
    pid = pl.program_id(0)
    n_row_blocks = ceil_div(n_rows, block_rows)
    if grid_size >= n_row_blocks:  # one row block per program
        row_block(pid * block_rows)
    else:
        def persistent(t, carry):
            row_block((pid + t * grid_size) * block_rows)
            return carry

        lax.fori_loop(I0, (n_row_blocks - pid + grid_size - 1) // grid_size, persistent, 0)
