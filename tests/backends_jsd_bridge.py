"""PyTorch calling the JAX/Pallas linear JSD through the DLPack bridge, joining the harness.

``lt.linear_jsd(..., backend="pallas")`` on torch tensors; tolerances are those of the naive
PyTorch path (the user's alternative on this side of the bridge)."""
import op_linear_jsd
from backends_jsd_torch import OP, jsd_runner
from harness import Backend, crossing_cases, register

register(Backend("bridge-pallas", jsd_runner("pallas"), naive="naive-torch",
                 requires=("torch", "jax"), op=OP,
                 takes=crossing_cases(op_linear_jsd.OP, {
                     "no targets": lambda c: not c.targets,
                     "all ignored": lambda c: c.ignore == "all",
                     "one token": lambda c: c.n == 1,
                     "teacher in another dtype": lambda c: bool(c.teacher_dtype)})))
