"""Test set-up shared by every suite.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any kernel
module is imported: here, before the tests import anything of ours. On a CUDA machine the
kernels run for real.
"""
import os
import sys
import zlib

import pytest

sys.path.insert(0, os.path.dirname(__file__))

CPU_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# XLA's older CPU emitters instead of its MLIR fusion emitters: they compile the interpreted
# Pallas programs ~2x faster (one JSD case's XLA compile 0.98 -> 0.56 s; the JAX-heavy test
# files 108 -> 71 s on two workers, jaxlib 0.10.2). Only where this jaxlib knows the flag: an
# unknown flag in XLA_FLAGS aborts the process, so a subprocess tries it first.
PROBED_CPU_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA takes ``flag`` (a CPU backend started with it in a
    subprocess; ~1 s, once per run: xdist workers and subprocess tests inherit the result)."""
    import subprocess
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


try:
    import torch
    _CUDA = torch.cuda.is_available()
    _CPU_ONLY = not _CUDA
except ImportError:  # a JAX-only environment (which may have a GPU for JAX)
    _CUDA = _CPU_ONLY = False
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
_FAST_INTERPRETER = False
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_speedup  # noqa: E402
    _FAST_INTERPRETER = interpreter_speedup.install()
if _CPU_ONLY:
    # XLA's CPU code generation without LLVM's optimizations: the JAX tests' time is mostly
    # XLA compiling interpreted Pallas kernels of tiny shapes, and running them is cheap
    # (tests/test_linear_jsd_jax.py: 131 -> 103 s). Subprocess workers inherit it.
    _given = os.environ.get("XLA_FLAGS", "")  # xdist workers inherit the controller's
    # a flag already set, to any value (the caller's, or the controller's for a worker), stays
    _set = {f.split("=")[0] for f in _given.split()}
    _flags = [f for f in CPU_XLA_FLAGS if f.split("=")[0] not in _set]
    _flags += [f for f in PROBED_CPU_XLA_FLAGS
               if f.split("=")[0] not in _set and _xla_knows(f)]
    os.environ["XLA_FLAGS"] = " ".join([_given, *_flags]).strip()
# torch and JAX share the GPU in one process: JAX must not grab 75% of it at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import harness  # noqa: E402

# pytest-xdist workers inherit this process's environment: one seed for the whole run
os.environ.setdefault("LOGITLESS_TEST_SEED", str(harness.SEED))


def pytest_report_header(config):
    return [f"logitless test seed: {harness.SEED} (set LOGITLESS_TEST_SEED to replay)",
            f"CUDA: {_CUDA}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
            f"{' (nested calls unpatched: tests/interpreter_speedup.py)' if _FAST_INTERPRETER else ''}"]


def _in_a_deep_frame():
    """``run(fn)``: ``fn()`` called from inside one frame of ~70k slots.

    CPython (3.11 on; 3.13.0 too: gh-142183) keeps frames in 16 KiB chunks of a per-thread
    stack and frees a chunk as soon as the frame that opened it returns: a loop that calls
    across a chunk boundary mmaps and munmaps 16 KiB on every call. The interpreted kernels
    (Triton's interpreter, Pallas' interpret mode) are such loops: strace counted ~485k 16 KiB mmaps in
    six interpreted JSD cases, whose time was ~40% system time. A frame this large makes
    CPython open a 1 MiB chunk for it with ~480 KiB free above, more than any test's stack
    needs, so the test runs inside one chunk (those six cases 12.4 -> 5.3 s on Python 3.11,
    the whole suite 613 -> 428 s)."""
    def run(fn):
        return fn()
    code = run.__code__
    names = code.co_varnames + tuple(f"_slot{i}" for i in range(70_000))
    run.__code__ = code.replace(co_varnames=names, co_nlocals=len(names))
    return run


_RUN_DEEP = _in_a_deep_frame()


def pytest_pyfunc_call(pyfuncitem):
    # pytest's own implementation (its return-value checks), one frame up. A plain hook: the
    # plugins' tryfirst ones (async runners) come first, pytest's own (trylast) never.
    from _pytest import python as _pytest_python
    from _pytest.compat import is_async_function
    if is_async_function(pyfuncitem.obj):
        return None
    _RUN_DEEP(lambda: _pytest_python.pytest_pyfunc_call(pyfuncitem))
    return True


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # again at the end: CI logs are often cut to their tail, and a failure needs the seed
    terminalreporter.write_line(f"logitless test seed: {harness.SEED} "
                                f"(LOGITLESS_TEST_SEED={harness.SEED} replays this run)")


@pytest.fixture(autouse=True)
def _seed_global_rngs(request):
    """Each test's global torch RNG (CPU and CUDA) starts from the session seed and the test's
    own id: a draw without an explicit generator is fresh per session, replayed by
    LOGITLESS_TEST_SEED, and independent of which tests ran before (and on which worker)."""
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(
            (harness.SEED + zlib.crc32(request.node.nodeid.encode())) % (1 << 63))
    yield
