"""How should the JAX path run GEMMs whose vocabulary V is not a multiple of 8 (GPT-2's 50257)?

Times the op's three GEMMs (logits x·Wᵀ, dX = dz·W, dW = dzᵀ·x in fp32) under jit, over token
chunks in a ``lax.fori_loop`` as the fused op runs them, three ways: as is (odd V), split at
the 8-aligned bulk of V (slices of W inside the loop), and with W padded once to a multiple
of 16 rows (dz then has the padded width, as a kernel could write it). Prints median ms and
XLA's temp bytes (a hoisted copy of W would show there).

    PYTHONPATH=. python3 benchmarks/jax_odd_vocab_probe.py [--n 10000 --h 1600 --v 50257]
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
from jax import lax


def _gemms(x, w, dz, chunk):
    n = x.shape[0]
    steps = n // chunk

    def body(i, carry):
        dx, dw, zs = carry
        xc = lax.dynamic_slice_in_dim(x, i * chunk, chunk)
        dzc = lax.dynamic_slice_in_dim(dz, i * chunk, chunk)
        z = jnp.dot(xc, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
        dxc = jnp.dot(dzc, w, preferred_element_type=jnp.float32).astype(x.dtype)
        dw = dw + jnp.dot(dzc.T, xc, preferred_element_type=jnp.float32)
        return (lax.dynamic_update_slice_in_dim(dx, dxc, i * chunk, 0), dw,
                zs + z[:, :8].astype(jnp.float32).sum())
    init = (jnp.zeros_like(x), jnp.zeros((w.shape[0], x.shape[1]), jnp.float32), 0.0)
    return lax.fori_loop(0, steps, body, init)


def whole(x, w, dz, chunk):
    return _gemms(x, w, dz, chunk)


def split(x, w, dz, chunk):
    v = w.shape[0]
    b = v - v % 8
    n = x.shape[0]

    def body(i, carry):
        dx, dw_a, dw_b, zs = carry
        xc = lax.dynamic_slice_in_dim(x, i * chunk, chunk)
        dzc = lax.dynamic_slice_in_dim(dz, i * chunk, chunk)
        za = jnp.dot(xc, w[:b].T, preferred_element_type=jnp.float32).astype(x.dtype)
        zb = jnp.dot(xc, w[b:].T, preferred_element_type=jnp.float32).astype(x.dtype)
        dxc = (jnp.dot(dzc[:, :b], w[:b], preferred_element_type=jnp.float32)
               + jnp.dot(dzc[:, b:], w[b:], preferred_element_type=jnp.float32)).astype(x.dtype)
        dw_a = dw_a + jnp.dot(dzc[:, :b].T, xc, preferred_element_type=jnp.float32)
        dw_b = dw_b + jnp.dot(dzc[:, b:].T, xc, preferred_element_type=jnp.float32)
        return (lax.dynamic_update_slice_in_dim(dx, dxc, i * chunk, 0), dw_a, dw_b,
                zs + za[:, :8].astype(jnp.float32).sum() + zb.astype(jnp.float32).sum())
    h = x.shape[1]
    init = (jnp.zeros_like(x), jnp.zeros((b, h), jnp.float32),
            jnp.zeros((v - b, h), jnp.float32), 0.0)
    return lax.fori_loop(0, n // chunk, body, init)


def padded(x, w, dz_padded, chunk):
    v = w.shape[0]
    wp = jnp.pad(w, ((0, -v % 16), (0, 0)))
    dx, dw, zs = _gemms(x, wp, dz_padded, chunk)
    return dx, dw[:v], zs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=10000)
    p.add_argument("--h", type=int, default=1600)
    p.add_argument("--v", type=int, default=50257)
    p.add_argument("--chunk", type=int, default=2000)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (a.n, a.h), jnp.bfloat16)
    w = (jax.random.normal(k[1], (a.v, a.h)) * 0.02).astype(jnp.bfloat16)
    vp = a.v + (-a.v % 16)
    dzp = (jax.random.normal(k[2], (a.n, vp)) * 1e-3).astype(jnp.bfloat16)
    dz = dzp[:, :a.v]
    out = {}
    for name, fn, args in (("whole", whole, (x, w, dz)), ("split", split, (x, w, dz)),
                           ("padded", padded, (x, w, dzp)),
                           ("aligned floor (V rounded up to 16)", whole,
                            (x, jnp.pad(w, ((0, vp - a.v), (0, 0))), dzp))):
        f = jax.jit(fn, static_argnums=3)
        comp = f.lower(*args, a.chunk).compile()
        temp = comp.memory_analysis().temp_size_in_bytes
        jax.block_until_ready(f(*args, a.chunk))
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args, a.chunk))
            ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        out[name] = dict(ms=ts[len(ts) // 2], temp_bytes=int(temp))
        print(f"{name:36s} {ts[len(ts) // 2]:8.2f} ms   temp {temp / 2**20:8.1f} MiB")
    print(json.dumps(dict(n=a.n, h=a.h, v=a.v, chunk=a.chunk, device=str(jax.devices()[0]),
                          jax=jax.__version__, results=out)))


if __name__ == "__main__":
    main()
