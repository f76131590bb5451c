"""PyTorch calling the JAX/Pallas linear JSD through the DLPack bridge, joining the harness.

``lt.linear_jsd(..., backend="pallas")`` on torch tensors; tolerances are those of the naive
PyTorch path (the user's alternative on this side of the bridge)."""
from backends_jsd_torch import OP, jsd_runner
from harness import Backend, register

register(Backend("bridge-pallas", jsd_runner("pallas"), naive="naive-torch",
                 requires=("torch", "jax"), op=OP))
