"""JAX backends of linear cross-entropy (xla, pallas) and the naive jnp path, joining the shared harness."""
