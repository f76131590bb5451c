"""PyTorch backends of linear JSD joining the shared harness (and the naive torch path)."""
from __future__ import annotations


import numpy as np

import op_linear_jsd
from harness import Backend, interpreted, register, tier_takes
from helpers import torch_jsd_loss

OP = "linear_jsd"


def torch_device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_inputs(case, inp):
    """Tensors on the test device; the teacher's also require grad, so that a gradient leaking
    into them is caught."""
    import torch
    dev = torch_device()
    t = lambda a, dt: torch.tensor(np.asarray(a, np.float32), dtype=getattr(torch, dt), device=dev)
    xs, ws = t(inp.xs, case.dtype).requires_grad_(), t(inp.ws, case.dtype).requires_grad_()
    xt, wt = t(inp.xt, case.t_dtype).requires_grad_(), t(inp.wt, case.t_dtype).requires_grad_()
    y = None if inp.y is None else torch.tensor(inp.y, device=dev)
    g = torch.tensor(np.asarray(inp.grad_output, np.float32), device=dev)
    return xs, ws, xt, wt, y, g


def torch_collect(loss, xs, ws, xt, wt, g):
    import torch
    torch.autograd.backward([loss], [g.to(loss.dtype)])
    assert xt.grad is None and wt.grad is None, "the teacher must get no gradient"
    f = lambda a: a.detach().double().cpu().numpy()
    return dict(loss=f(loss), dx=f(xs.grad), dw=f(ws.grad))


def jsd_runner(backend, **fixed_tuning):
    def run(case, inp):
        import logitless.torch as lt
        xs, ws, xt, wt, y, g = torch_inputs(case, inp)
        tuning = dict(fixed_tuning)
        if case.chunk_size:
            tuning["chunk_size"] = case.chunk_size
        loss = lt.linear_jsd(xs, ws, xt, wt, y, beta=case.beta, temperature=case.temperature,
                             ignore_index=inp.ignore_index, reduction=case.reduction,
                             hard_loss_weight=case.hard_loss_weight, backend=backend, **tuning)
        return torch_collect(loss, xs, ws, xt, wt, g)
    return run


def _half_gemm_fp32_logits():
    """``x @ w.T`` as the GEMMs of a fused loss run it: fp32 output from input-dtype operands;
    backward rounds the logits' gradient to the input dtype for the dX / dW GEMMs."""
    import torch

    class HalfGemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x.float() @ w.float().t()

        @staticmethod
        def backward(ctx, dz):
            x, w = ctx.saved_tensors
            d = dz.to(x.dtype)
            return d @ w, d.t() @ x
    return HalfGemm.apply


def naive_torch_jsd(case, inp):
    """A careful user's version, Liger's recipe: both logits materialized in fp32 from the
    input-dtype GEMM, F.kl_div / F.cross_entropy, autograd, the backward GEMMs in the input
    dtype (see op_linear_jsd for why)."""
    import torch
    xs, ws, xt, wt, y, g = torch_inputs(case, inp)
    zs = _half_gemm_fp32_logits()(xs, ws)
    with torch.no_grad():
        zt = xt.float() @ wt.float().t()
    n = zs.shape[0]
    mask = torch.ones(n, device=zs.device) if y is None else (y != inp.ignore_index).float()
    loss, _ = torch_jsd_loss(zs, zt, y, mask, beta=case.beta, temperature=case.temperature,
                             hard_loss_weight=case.hard_loss_weight,
                             ignore_index=inp.ignore_index, reduction=case.reduction)
    return torch_collect(loss, xs, ws, xt, wt, g)


def _split_takes(case):
    """Interpreted, the small blocks make this backend the suite's slowest (~5x backend
    "triton" per case): there it takes what segments change (the per-row merges of every
    kind, hard-label term, targets and ignore pattern) in float32, where the merges' rounding
    shows most, and of those (~10 s each) the ones that merge the most: the hard-label
    term, no targets, every token ignored, N = 1, and the KL kinds with a teacher offset
    (their far forms); the other cases run on backend "triton" (which shares the kernels),
    and confident heads' merges are the sharp-teacher accuracy test's. On a GPU it is the
    only test of the fused kernel with per-row barriers (``row_sync=True``): every case."""
    if not interpreted():
        return True
    merges_most = (case.hard_loss_weight or not case.targets or case.ignore == "all"
                   or case.n == 1 or case.teacher_offset)
    return (case.dtype == "float32" and not case.chunk_size and not case.teacher_dtype
            and bool(merges_most))


def triton_split_runner(case, inp):
    """Rows split over several programs with a ragged last segment: on a GPU the fused kernel
    waits at its per-row barriers (64-column segments: up to 17 programs per row); in the
    interpreter, which runs programs one by one, the three-launch path over two segments of
    one block each (its cost grows with programs x blocks; several blocks per segment are
    test_triton_tunings_match_the_torch_backend's "blocks-ragged")."""
    import torch
    if torch.cuda.is_available():  # row_sync=True: the fused kernel is no longer the default
        return jsd_runner("triton", block_v=32, segment_size=64, row_sync=True)(case, inp)
    segment = max(16, 1 << (-(-case.v // 2) - 1).bit_length())  # a power of 2 >= V / 2
    return jsd_runner("triton", block_v=segment, segment_size=segment)(case, inp)


register(Backend("naive-torch", naive_torch_jsd, naive="naive-torch", requires=("torch",), op=OP))
register(Backend("torch", jsd_runner("torch"), naive="naive-torch", requires=("torch",), op=OP))
register(Backend("triton", jsd_runner("triton"), naive="naive-torch",
                 requires=("torch", "triton"), op=OP, takes=tier_takes(op_linear_jsd.OP)))
register(Backend("triton-split", triton_split_runner, naive="naive-torch",
                 requires=("torch", "triton"), op=OP, takes=_split_takes))
