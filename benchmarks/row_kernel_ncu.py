"""GPU probe for Nsight Compute: one fast-mode fwd+bwd of linear CE on the Triton backend
(``triton``) or the Pallas one (``pallas``), N=4096, H=4096, V=128256, 2048-token chunks, so
that ncu can compare the two row kernels on the same logits:

    PYTHONPATH=. ncu --target-processes all -k regex:cross_entropy_rows -s 2 -c 2 \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
    dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,\\
    sm__warps_active.avg.pct_of_peak_sustained_active python3 benchmarks/row_kernel_ncu.py triton

(``-s 2`` skips the first call's kernels.) Results: ``results/…-s17-row-kernel-ncu.txt``.
``jsd``: one Triton linear JSD fwd+bwd (β = 0.5, N = 2048, the default chunks: 384-row
launches of the three-pass row kernel, ``-k regex:jsd_rows``; ``results/…-s35-jsd-rows-ncu.txt``).
"""
import sys

N, H, V, CHUNK = 4096, 4096, 128256, 2048


def main(which: str) -> None:
    if which == "triton":
        import torch

        import logitless.torch as lt
        x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        y = torch.randint(0, V, (N,), device="cuda")
        for _ in range(2):
            lt.linear_cross_entropy(x, w, y, backend="triton", chunk_size=CHUNK).backward()
        torch.cuda.synchronize()
    elif which == "pallas":
        import jax
        import jax.numpy as jnp

        import logitless.jax as lj
        k = jax.random.split(jax.random.PRNGKey(0), 3)
        x = jax.random.normal(k[0], (N, H), jnp.bfloat16)
        w = (jax.random.normal(k[1], (V, H)) * 0.02).astype(jnp.bfloat16)
        y = jax.random.randint(k[2], (N,), 0, V)
        f = jax.jit(jax.value_and_grad(lambda x, w: lj.linear_cross_entropy(
            x, w, y, backend="pallas", chunk_size=CHUNK), argnums=(0, 1)))
        for _ in range(2):
            jax.block_until_ready(f(x, w))
    elif which == "jsd":
        import torch

        import logitless.torch as lt
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = (torch.randn(2048, H, device="cuda", generator=g) * 0.5).bfloat16()
        ws = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
        xt = (torch.randn(2048, H, device="cuda", generator=g) * 0.5).bfloat16()
        wt = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
        xs.requires_grad_()
        ws.requires_grad_()
        for _ in range(2):
            lt.linear_jsd(xs, ws, xt, wt, beta=0.5, backend="triton").backward()
        torch.cuda.synchronize()
    else:
        raise SystemExit("usage: row_kernel_ncu.py triton|pallas|jsd")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "triton")
