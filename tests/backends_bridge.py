"""PyTorch calling the JAX/Pallas port through the DLPack bridge, joining the shared harness.

``lt.linear_cross_entropy(..., backend="pallas")`` on torch tensors: the bridge converts them
zero-copy, runs ``logitless.jax.linear_cross_entropy(backend="pallas")`` forward and backward
through ``jax.vjp``, and hands the results back to torch autograd. Tolerances are those of
the naive PyTorch path (the user's alternative on this side of the bridge).
"""
from backends_torch import torch_backend_runner
from harness import Backend, register

register(Backend("bridge-pallas", torch_backend_runner("pallas"), naive="naive-torch",
                 requires=("torch", "jax")))
