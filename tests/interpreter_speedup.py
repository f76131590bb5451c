"""Make Triton's interpreter skip a redundant step, for CI time (tests only; never on a GPU).

Every call of a nested ``@triton.jit`` function under ``TRITON_INTERPRET=1`` re-patches the
whole ``triton.language`` namespace (``inspect.getmembers`` over ``tl``, ``tl.tensor``,
``tl.math``, ...). The row kernels call their helpers per row and per block: without the
re-patch the Triton-interpreted linear-CE spec cases ran 8% faster (133.7 -> 122.6 s, one
seed, 2 workers). The launch (``GridExecutor.__call__``) has already patched those modules
and restores them when its grid ends, and a nested call's patch is never restored (read in
triton 3.7.1, the CI pin), so inside a launch it changes nothing: here a nested call whose
modules the launch has patched runs its function directly. Where Triton's internals differ
from what this expects, nothing is changed.
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

    launches = []  # the language modules of each launch in progress
    grid_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__

    def launch(self, *args, **kwargs):
        launches.append(modules(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def nested(self, *args, **kwargs):
        if not launches or not modules(self.fn) <= launches[-1]:
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own device call reports it
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = nested
    ti._logitless_fast = True
    return True
