"""The tiled SwiGLU MLP's Triton kernels on ragged shapes ([2, 53, 40]: 106 tokens in 4 shards, I = 70), for
compute-sanitizer memcheck (benchmarks/memcheck/README.md)."""
import torch
import logitless.torch as lt
torch.manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    m = lt.SwiGLUMLP(40, 70, dtype=dt, device="cuda")
    x = torch.randn(2, 53, 40, device="cuda", dtype=dt, requires_grad=True)
    for acc in (None, torch.float32):
        y = lt.tiled_mlp(m, x, num_shards=4, grad_accum_dtype=acc)
        y.sum().backward()
        torch.cuda.synchronize()
        print("torch mlp", dt, acc, float(x.grad.float().abs().sum()))
        x.grad = None
        for p in m.parameters():
            p.grad = None
