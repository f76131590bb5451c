"""The Triton linear CE and JSD kernels with every option on ragged rows and vocabulary, in each
mode (the CE's ``skip_ignored`` with a whole chunk ignored too), for compute-sanitizer memcheck
(benchmarks/memcheck/README.md)."""
import torch
import logitless.torch as lt
torch.manual_seed(0)
dev = "cuda"
n, v = 37, 97
for dt, h in ((torch.float32, 33), (torch.bfloat16, 33), (torch.bfloat16, 40)):
    x = torch.randn(n, h, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(v, h, device=dev) / 6).to(dt).requires_grad_()
    b = torch.randn(v, device=dev, dtype=dt, requires_grad=True)
    y = torch.randint(0, v, (n,), device=dev)
    y[3] = -100
    cw = torch.rand(v, device=dev)
    xt, wt = torch.randn(n, 20, device=dev, dtype=dt), (torch.randn(v, 20, device=dev) / 5).to(dt)
    modes = [dict(), dict(low_memory=True), dict(block_v=16), dict(reduction="none"),
             dict(chunk_size=16), dict(block_v=16, segment_size=32),  # split rows: one launch
             dict(block_v=16, segment_size=32, row_sync=False)]     # and two
    if dt != torch.float32 and dev == "cuda" and h % 8 == 0:  # TMA: 16-byte rows
        modes += [dict(logits_gemm="triton"), dict(logits_gemm="triton", low_memory=True)]
    for kw in modes:
        red = kw.pop("reduction", "mean")
        ls = 0.0 if "logits_gemm" in kw else 0.2  # the own GEMM's epilogue takes no smoothing
        out = lt.linear_cross_entropy(x, w, y, backend="triton", linear_bias=b, weight=cw,
                                      label_smoothing=ls, z_loss=1e-2, softcap=5.0,
                                      reduction=red, return_lse=True, **kw)
        loss, lse = out
        (loss.sum() + 0.1 * lse.sum()).backward()
        torch.cuda.synchronize()
        print("ce", dt, kw, red, float(x.grad.abs().sum()))
        x.grad = w.grad = b.grad = None
    if dt != torch.float32 and h % 8 == 0:  # skip_ignored: live-first chunks, live counts
        y_skip = y.clone()
        y_skip[16:32] = -100  # a whole chunk of 16 ignored: a live count of 0
        for kw in (dict(), dict(chunk_size=16), dict(chunk_size=16, dx_gemm="triton"),
                   dict(chunk_size=16, block_v=16, segment_size=32),
                   dict(chunk_size=16, block_v=16, segment_size=32, row_sync=False)):
            loss = lt.linear_cross_entropy(x, w, y_skip, backend="triton", linear_bias=b,
                                           weight=cw, label_smoothing=0.2, z_loss=1e-2,
                                           softcap=5.0, skip_ignored=True, **kw)
            loss.backward()
            torch.cuda.synchronize()
            print("ce skip_ignored", dt, kw, float(x.grad.abs().sum()))
            x.grad = w.grad = b.grad = None
    for kw in (dict(), dict(block_v=32, segment_size=64),
               dict(block_v=32, segment_size=64, row_sync=True), dict(fp32_logits=False),
               dict(chunk_size=16)):
        for beta in (0.0, 0.5, 1.0):
            loss = lt.linear_jsd(x, w, xt, wt, y, beta=beta, temperature=1.5,
                                 hard_loss_weight=0.3, backend="triton", **kw)
            loss.backward()
            torch.cuda.synchronize()
            print("jsd", dt, kw, beta, float(x.grad.abs().sum()))
            x.grad = w.grad = None
