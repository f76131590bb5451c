"""Pallas kernels (Triton backend on GPU, interpret mode elsewhere) and their ``jax.custom_vjp`` glue.

One module per op; the public entry points are in :mod:`logitless.jax`.
"""
