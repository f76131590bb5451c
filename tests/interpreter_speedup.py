"""Make Triton's interpreter skip a redundant step, for CI time (tests only; never on a GPU).

Every call of a nested ``@triton.jit`` function under ``TRITON_INTERPRET=1`` re-patches the
whole ``triton.language`` namespace (``inspect.getmembers`` over ``tl``, ``tl.tensor``,
``tl.math``, ...). The row kernels call their helpers per row and per block: without the
re-patch the Triton-interpreted linear-CE spec cases ran 8% faster (133.7 -> 122.6 s, one
seed, 2 workers). The launch (``GridExecutor.__call__``) has already patched those modules
and restores them when its grid ends, and a nested call's patch is never restored (read in
triton 3.7.1, the CI pin), so inside a launch it changes nothing: here a nested call whose
modules the launch has patched runs its function directly. Where Triton's internals differ
from what this expects, nothing is changed. A nested call of a function whose module sees
modules the launch did not patch (``tl.sum``, ``tl.max``: ``tl.core``) patches them once per
launch, as its first call there would. And Triton's dtype -> NumPy dtype map, rebuilt on every
call, is looked up once per dtype. Both together: the interpreted Triton cases of CE and JSD
gave bit-identical outputs with and without them (41 cases, one seed), 16-28% faster
(twenty-ninth session). Third (thirty-sixth session): a binary op whose operands are tensors
of one fp32/fp64/integer type skips the implicit promotion and broadcasting, which return them
unchanged (``_same_type_fast_path``: ~35% of the calls; an interpreted Triton JSD case 5-10%
faster; 12 CE and JSD cases, fp32 and bf16, bit-identical with and without it).
"""
import inspect

_EXPECTED = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang")


def install() -> bool:
    """Wrap the interpreter's launch and device-call entry points; False if not applicable."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    if not all(hasattr(ti, name) for name in _EXPECTED) or getattr(ti, "_logitless_fast", False):
        return False
    if "_patch_lang(self.fn)" not in inspect.getsource(ti.InterpretedFunction.__call__):
        return False  # a Triton whose device call does something else: leave it alone
    languages = (tl, tl.core)
    seen = {}

    def modules(fn):  # the language modules fn sees (what _patch_lang would patch for it)
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and any(v is m for m in languages))
        return seen[key]

    launches = []  # per launch in progress: the language modules patched so far
    grid_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__

    def launch(self, *args, **kwargs):
        launches.append(set(modules(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def nested(self, *args, **kwargs):
        if not launches:
            return device_call(self, *args, **kwargs)
        if not modules(self.fn) <= launches[-1]:
            # e.g. tl.sum, whose module sees tl.core, which the launch did not patch: patch
            # once (as Triton does, never restored); later calls in this launch find it done
            out = device_call(self, *args, **kwargs)
            launches[-1] |= modules(self.fn)
            return out
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own device call reports it
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = nested
    if hasattr(ti, "_get_np_dtype"):
        ti._get_np_dtype = _cached_np_dtype(ti._get_np_dtype, tl)
    sem = getattr(ti, "interpreter_semantic", None)
    if sem is not None and hasattr(sem, "binary_op_type_checking_impl"):
        sem.binary_op_type_checking_impl = _same_type_fast_path(
            sem.binary_op_type_checking_impl, sem, tl)
    ti._logitless_fast = True
    return True


def _same_type_fast_path(check, sem, tl):
    """Triton's implicit promotion and broadcasting of a binary op's operands (~45% of an
    interpreted row kernel's time) returns both operands unchanged when they are tensors of
    one type (same element type and shape) that no promotion touches: fp32 / fp64, or one
    integer type outside / and % (read in triton 3.7.1: computation_type_impl gives that type
    back, cast returns its input, broadcast_impl_value leaves equal shapes alone). Those
    pairs skip it; every other pair (scalars, pointers, 16-bit floats, broadcasts) runs it."""
    tensor = sem.tensor

    def fast(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True,
             div_or_mod=False):
        if (arithmetic_check and type(lhs) is tensor and type(rhs) is tensor
                and lhs.type == rhs.type):
            sca = lhs.type.scalar
            if sca is tl.float32 or sca is tl.float64 or (
                    not div_or_mod and sca.is_int() and not sca.is_ptr()):
                return lhs, rhs
        return check(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
    return fast


def _cached_np_dtype(get_np_dtype, tl):
    """Triton's dtype -> NumPy dtype map rebuilds its 18-entry dict on every call (~10% of an
    interpreted row kernel's time): the same answers, looked up once per scalar dtype."""
    cache = {}

    def cached(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return get_np_dtype(tt_dtype)
        if scalar not in cache:
            cache[scalar] = get_np_dtype(scalar)
        return cache[scalar]
    return cached
