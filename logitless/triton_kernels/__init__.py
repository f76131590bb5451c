"""Triton kernels and their PyTorch glue (autograd, torch.library ops), one module per op."""
import triton

# Triton decides interpreter-or-GPU when kernels are decorated (import time): read it once
# here, so nothing on the hot path touches the environment (torch.compile could not trace it).
INTERPRETED = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False
