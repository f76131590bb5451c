"""PyTorch calling the JAX/Pallas port through the DLPack bridge, joining the shared harness.

``lt.linear_cross_entropy(..., backend="pallas")`` on torch tensors: the bridge converts them
zero-copy, runs ``logitless.jax.linear_cross_entropy(backend="pallas")`` forward and backward
through ``jax.vjp``, and hands the results back to torch autograd. Tolerances are scaled by
the naive *JAX* path: the numbers are JAX's (its GEMMs round the bf16 logits), and torch's CPU
GEMMs round them differently, which at N=1 alone can exceed the bf16 floor.
"""
from backends_torch import torch_backend_runner
from harness import Backend, crossing_cases, register
from op_linear_cross_entropy import OP

register(Backend("bridge-pallas", torch_backend_runner("pallas"), naive="naive-jax",
                 requires=("torch", "jax"),
                 takes=crossing_cases(OP, {"all ignored": lambda c: c.ignore == "all",
                                           "masked classes": lambda c: c.masked,
                                           "one token": lambda c: c.n == 1})))
