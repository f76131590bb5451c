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

try:
    import torch
    _CUDA = torch.cuda.is_available()
except ImportError:  # a JAX-only environment
    _CUDA = False
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# torch and JAX share the GPU in one process: JAX must not grab 75% of it at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import harness  # noqa: E402

# pytest-xdist workers inherit this process's environment: one seed for the whole run
os.environ.setdefault("LOGITLESS_TEST_SEED", str(harness.SEED))


def pytest_report_header(config):
    return [f"logitless test seed: {harness.SEED} (set LOGITLESS_TEST_SEED to replay)",
            f"CUDA: {_CUDA}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"]


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
