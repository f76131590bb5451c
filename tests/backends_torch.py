"""PyTorch backends of linear cross-entropy joining the shared harness (and the naive torch path)."""
from __future__ import annotations

import importlib.util

import numpy as np

import op_linear_cross_entropy as op
from harness import Backend, interpreted, register, tier_takes


def _have(mod):
    return importlib.util.find_spec(mod) is not None


# ----------------------------------------------------------------------------- PyTorch
def torch_device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_inputs(case, inp):
    import torch
    dev, dt = torch_device(), getattr(torch, case.dtype)
    t = lambda a, dtype=dt: None if a is None else torch.tensor(
        np.asarray(a, np.float32), dtype=dtype, device=dev)
    x, w, b = t(inp.x).requires_grad_(), t(inp.w).requires_grad_(), t(inp.bias)
    if b is not None:
        b.requires_grad_()
    y = torch.tensor(inp.y, device=dev)
    return x, w, b, y, t(inp.class_weight, torch.float32), t(inp.grad_output, torch.float32), \
        t(inp.grad_lse, torch.float32)


def _torch_collect(case, loss, lse, x, w, b, g, gl):
    import torch
    outs, grads = [loss], [g]
    if case.lse_grad:
        outs.append(lse)
        grads.append(gl)
    torch.autograd.backward(outs, grads)
    f = lambda a: a.detach().double().cpu().numpy()
    r = dict(loss=f(loss), dx=f(x.grad), dw=f(w.grad))
    if case.lse_grad:
        r["lse"] = f(lse)
    if case.bias:
        r["db"] = f(b.grad)
    return r


def torch_backend_runner(backend, **fixed_tuning):
    def run(case, inp):
        import logitless.torch as lt
        x, w, b, y, cw, g, gl = _torch_inputs(case, inp)
        tuning = dict(fixed_tuning)
        if case.chunk_size:
            tuning["chunk_size"] = case.chunk_size
        # lse only where the case checks it: the call users make otherwise (on a Hopper GPU
        # the fast mode then skips ignored tokens by default, skip_ignored="auto")
        out = lt.linear_cross_entropy(
            x, w, y, linear_bias=b, weight=cw, reduction=case.reduction,
            label_smoothing=case.label_smoothing, z_loss=case.z_loss, softcap=case.softcap,
            return_lse=case.lse_grad, backend=backend, ignore_index=case.ignore_index, **tuning)
        loss, lse = out if case.lse_grad else (out, None)
        return _torch_collect(case, loss, lse, x, w, b, g, gl)
    return run


def naive_torch(case, inp):
    """What a user writes without this library: materialized logits, F.cross_entropy."""
    import torch
    import torch.nn.functional as F
    x, w, b, y, cw, g, gl = _torch_inputs(case, inp)
    c = F.linear(x, w, b).float()
    if case.softcap:
        c = case.softcap * torch.tanh(c / case.softcap)
    tok = F.cross_entropy(c, y, weight=cw, reduction="none", label_smoothing=case.label_smoothing,
                          ignore_index=case.ignore_index)
    lse = torch.logsumexp(c, dim=-1)
    mask = y != case.ignore_index
    ys = torch.where(mask, y, 0)
    omega = mask.float() if cw is None else cw[ys] * mask
    tok = tok + case.z_loss * omega * lse ** 2
    if case.reduction == "none":
        loss = tok
    elif case.reduction == "sum":
        loss = tok.sum()
    else:
        loss = tok.sum() / omega.sum().clamp_min(1e-30)
    return _torch_collect(case, loss, lse, x, w, b, g, gl)


register(Backend("naive-torch", naive_torch, naive="naive-torch", requires=("torch",)))
register(Backend("torch", torch_backend_runner("torch"), naive="naive-torch", requires=("torch",)))
register(Backend("triton", torch_backend_runner("triton"), naive="naive-torch",
                 requires=("torch", "triton"), takes=tier_takes(op.OP)))


def blocks_takes(case):
    """The row kernel's online max / rescale across column blocks (32-column blocks: 4 per
    row at V = 97), which the default block (one per row at these V) never runs: every case on
    a GPU; in the interpreter (CI time: ~5 s a case) the masked ones (-inf bias over whole
    leading blocks) and the every-option one in three dtype / reduction pairs (as
    ``split_takes``: the blocks' rescale does not depend on them)."""
    if not interpreted():
        return True
    return case.v == 97 and case.ignore != "all" and (case.masked or _every_option_triple(case))


def _every_option_triple(case):
    """The every-option case in (bf16, mean), (fp32, none), (fp16, sum): each dtype and each
    reduction once."""
    return bool(case.softcap and case.z_loss and case.label_smoothing) and (
        case.dtype, case.reduction) in (("bfloat16", "mean"), ("float32", "none"),
                                        ("float16", "sum"))


register(Backend("triton-blocks", torch_backend_runner("triton", block_v=32), naive="naive-torch",
                 requires=("torch", "triton"), takes=blocks_takes))


def split_takes(case):
    """Rows split over programs: every case on a GPU (one launch, the segments waiting for
    each other); interpreted (two launches: the partials' merge; CI time ~5-13 s a case) the
    masked cases (fp32 and bf16) and the every-option one in fp32 with per-token upstream
    gradients ("none", an lse gradient): the merge does not depend on the dtype, and
    test_triton_backend's split tests run the one-launch form."""
    if not interpreted():
        return True
    every = bool(case.softcap and case.z_loss and case.label_smoothing)
    return case.v == 97 and case.ignore != "all" and (case.masked or every and (
        case.dtype, case.reduction) == ("float32", "none"))


# Rows split over programs (segment_size): 32-column segments of 16-column blocks, 4 segments
# at V = 97 (the last of 1 column).
register(Backend("triton-split", torch_backend_runner("triton", block_v=16, segment_size=32),
                 naive="naive-torch", requires=("torch", "triton"), takes=split_takes))


def own_gemm_takes(case):
    """The cases the statistics-epilogue GEMM can take: half precision, no label smoothing,
    rows of a multiple of 8 elements (TMA alignment). The parity suite runs it on every case,
    so elsewhere it takes cuBLAS, the default."""
    return case.dtype != "float32" and not case.label_smoothing and case.h % 8 == 0


def own_gemm_runner(case, inp):
    """backend="triton" with logits_gemm="triton" where it applies: the forward's logits with
    their statistics; and the recomputing sweeps' dz straight from the GEMM, which "none"
    cases (token sweep) and "sum" cases, run in low-memory mode (vocabulary sweep), reach."""
    if not own_gemm_takes(case):
        return torch_backend_runner("triton")(case, inp)
    lowmem = dict(low_memory=True, vocab_chunk_size=64) if case.reduction == "sum" else {}
    return torch_backend_runner("triton", logits_gemm="triton", **lowmem)(case, inp)


register(Backend("triton-own-gemm", own_gemm_runner, naive="naive-torch",
                 requires=("torch", "triton"), takes=own_gemm_takes))


def low_memory_runner(**tuning):
    """The low-memory operating point. Small vocabulary chunks exercise the multi-chunk dW
    sweep, a ragged last chunk included: 64 classes, 256 where V > 256 (2-5 chunks; the
    interpreter's time grows with rows x chunks: 64 made the wide cases 11-18 s each)."""
    def run(case, inp):
        return torch_backend_runner("triton", low_memory=True,
                                    vocab_chunk_size=64 if case.v <= 256 else 256,
                                    **tuning)(case, inp)
    return run


def low_memory_takes(case):
    """Every case on a GPU; interpreted (CI time: ~2 s a case, 6-15 s at 130 x 48 x 509) all
    but the one-option and the no-option 37 x 33 ones: the every-option cases carry those
    options, every dtype and reduction through the same sweeps (the row kernel's math per
    option is backend "triton"'s). Of the many-chunk 130 x 48 x 509 cases one: per-token
    upstream gradients ("none": the recomputing token sweep over several chunks, then the
    vocabulary sweep). The mean's forward dX over several chunks is the fast forward's code
    with dW left out (``DX_ONLY``), which backend "triton" runs on the bf16 every-option 130 x
    48 x 509 cases; the low-memory one (14 s interpreted) is the GPU runs'. fp16 sums and lse
    gradients take the same sweeps in the smaller cases, and the one without smoothing is for
    the own GEMM. The interpreters' tier (``op.cpu_tier``) applies on top: of the every-option
    37 x 33 cases, one per dtype and reduction."""
    if not interpreted():
        return True
    plain = op.options_on(case) == 0 and not case.masked and case.n == 37
    if case.n == 130:
        return case.reduction == "none"
    return not (op.single_option(case) or plain)


# cuBLAS pinned: the default ("auto") takes our GEMMs on a Hopper GPU where they can run, the
# second backend below; cuBLAS is what every other GPU runs.
register(Backend("triton-low-memory", low_memory_runner(logits_gemm="cublas"),
                 naive="naive-torch", requires=("torch", "triton"),
                 takes=tier_takes(op.OP, low_memory_takes)))


def low_memory_auto_takes(case):
    """Where the low-memory default differs from cuBLAS: a Hopper GPU, the GEMM's cases."""
    import torch
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
            and own_gemm_takes(case))


register(Backend("triton-low-memory-auto", low_memory_runner(),
                 naive="naive-torch", requires=("torch", "triton"), takes=low_memory_auto_takes))


def skip_ignored_fits(case):
    """The cases ``skip_ignored=True`` can run: half precision, H a multiple of 8 (the tensor
    descriptors), no lse returned, mean/sum (per-token upstream gradients recompute from every
    token's lse)."""
    return (case.dtype != "float32" and case.h % 8 == 0 and not case.lse_grad
            and case.reduction != "none")


def skip_ignored_takes(case):
    """Where it fits; interpreted (CI time), the 45 x 32 fp16 sum with bias and z-loss (the
    unit tests in test_triton_backend take both dtypes over several chunks, every option, a
    whole chunk ignored, all, none, split rows). On a Hopper GPU ``"auto"`` takes it for
    backend ``triton`` too."""
    return skip_ignored_fits(case) and (not interpreted() or case.n == 45)


def skip_ignored_runner(case, inp):
    """skip_ignored=True where it fits, the default elsewhere (as triton-own-gemm's runner)."""
    tuning = dict(skip_ignored=True) if skip_ignored_fits(case) else {}
    return torch_backend_runner("triton", **tuning)(case, inp)


register(Backend("triton-skip-ignored", skip_ignored_runner, naive="naive-torch",
                 requires=("torch", "triton"), takes=skip_ignored_takes))
