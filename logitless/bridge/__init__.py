"""The PyTorch <-> JAX bridge: the only place in logitless that imports both frameworks.

* :mod:`.dlpack` — :func:`to_jax` / :func:`to_torch`, zero-copy over DLPack on CPU and CUDA,
  with every copy explicit (:func:`would_copy`, ``copy=False``) and stream-ordered on CUDA.
* :mod:`.autograd` — :class:`JaxFunction`: any JAX function as a ``torch.autograd`` op
  (forward and ``jax.vjp`` backward jit-compiled once per static config, tensors crossing
  zero-copy).
* :mod:`.linear_cross_entropy` — ``logitless.torch.linear_cross_entropy(..., backend="pallas")``.
* :mod:`.linear_jsd` — ``logitless.torch.linear_jsd(..., backend="pallas")``.

GPU memory when both frameworks share a card
--------------------------------------------
By default JAX reserves 75% of the GPU when its CUDA backend starts, which starves PyTorch in
the same process. Importing this package therefore sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
(JAX then allocates on demand, from its own pool) -- but only when the user has not set that
variable and JAX has not been imported yet, since the variable is the user's to choose and an
already-imported JAX may already have started its backend. In the other case, on a CUDA
machine, a :class:`RuntimeWarning` says what to do: set ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
(or a small ``XLA_PYTHON_CLIENT_MEM_FRACTION``) before importing JAX. Memory JAX frees returns
to JAX's pool, not to PyTorch's caching allocator; ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``
returns it to the driver at a speed cost.
"""
from __future__ import annotations

import os
import sys
import warnings

PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"


def _configure_jax_memory(environ=None, modules=None, cuda_available=None):
    """Apply the preallocation policy above; returns what it did (``"set"``, ``"user"``,
    ``"warned"`` or ``"late"``: JAX imported first on a machine without CUDA, nothing to do)."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if PREALLOCATE_VAR in environ:
        return "user"
    if "jax" not in modules:
        environ[PREALLOCATE_VAR] = "false"
        return "set"
    if cuda_available is None:
        import torch
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return "late"
    warnings.warn(
        f"logitless.bridge was imported after jax with {PREALLOCATE_VAR} unset: if JAX's GPU "
        "backend starts with that default it reserves 75% of the GPU, leaving little to "
        f"PyTorch. Set {PREALLOCATE_VAR}=false (or a small XLA_PYTHON_CLIENT_MEM_FRACTION) "
        "before importing jax.", RuntimeWarning, stacklevel=3)
    return "warned"


_configure_jax_memory()

from .dlpack import ZeroCopyError, to_jax, to_torch, would_copy  # noqa: E402
from .autograd import JaxFunction  # noqa: E402

__all__ = ["to_jax", "to_torch", "would_copy", "ZeroCopyError", "JaxFunction"]
