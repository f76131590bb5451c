"""Triton-backend behaviour beyond the shared harness: torch.compile, non-contiguous inputs,
the bf16 accumulator option, argument errors; on a GPU also 64-bit indexing, CUDA-graph
capture of a training step and the absence of host syncs."""
import numpy as np
import pytest
import torch

import logitless.torch as lt
from harness import SEED
from helpers import (assert_row_padding_never_counted, check_cuda_graph_training,
                     graph_batches, no_host_sync)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _data(n, h, v, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator().manual_seed(SEED + seed)
    x = torch.randn(n, h, generator=g).to(device, dtype)
    w = (torch.randn(v, h, generator=g) * (2.0 / h ** 0.5)).to(device, dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    return x, w, y.to(device)


def _loss_and_grads(x, w, y, **kw):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    loss = lt.linear_cross_entropy(x, w, y, **kw)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def test_torch_compile_fullgraph_matches_eager():
    x, w, y = _data(37, 33, 97)
    kw = dict(backend="triton", label_smoothing=0.1, z_loss=1e-3, softcap=8.0)
    ref = _loss_and_grads(x, w, y, **kw)

    def step(x, w, y):
        return lt.linear_cross_entropy(x, w, y, **kw)

    # No on-disk caches: a cached backward graph is keyed by the traced graph, not by our
    # Python autograd code, so after an edit of that code it could replay the old one.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True)
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = compiled(xc, wc, y)
        loss.backward()
    for a, b in zip(ref, (loss.detach(), xc.grad, wc.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("low_memory", [False, True])
def test_non_contiguous_inputs(low_memory):
    # a transposed tied embedding (H, V) as the head, and a strided slice of a hidden state
    x_wide, _, y = _data(40, 66, 101, seed=1)
    emb = torch.randn(33, 101, device=DEV)  # (H, V): its .t() is a non-contiguous (V, H)
    x = x_wide[:, ::2]
    assert not x.is_contiguous() and not emb.t().is_contiguous()
    kw = dict(backend="triton", low_memory=low_memory, reduction="sum")
    a = _loss_and_grads(x, emb.t(), y, **kw)
    b = _loss_and_grads(x.contiguous(), emb.t().contiguous(), y, **kw)
    for u, v in zip(a, b):
        # same values up to fp32 rounding (cuBLAS may pick other algorithms for other strides)
        assert ((u - v).norm() / v.norm()).item() < 1e-5


@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_non_contiguous_bias(layout, low_memory):
    """The row kernel reads the bias at unit stride: a strided slice was read as the first V
    entries and an expanded (stride 0) bias past its storage, until ``_torch_common.prepare`` made
    it contiguous (as it does the targets and class weights). Its gradient still reaches the original tensor."""
    x, w, y = _data(24, 16, 37, seed=3)
    g = torch.Generator().manual_seed(SEED + 4)
    base = torch.randn(2 * 37, generator=g).to(DEV)

    def bias_of(t):
        return t[::2] if layout == "strided" else t[:1].expand(37)

    grads = []
    for contiguous in (False, True):
        src = base.clone().requires_grad_()
        b = bias_of(src)
        b = b.contiguous() if contiguous else b
        assert b.is_contiguous() == contiguous
        got = _loss_and_grads(x, w, y, backend="triton", low_memory=low_memory, linear_bias=b,
                              reduction="sum")
        grads.append(got + (src.grad,))
    for u, v in zip(*grads):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def test_bf16_accumulator_option_is_close_but_fp32_is_default():
    """The default sums dW over 16 chunks in fp32 and rounds once: its error is that of one
    chunk (one GEMM, one rounding); the bf16 accumulator's is visibly larger. (Loose bounds
    alone let a default that had become bf16 pass.)"""
    x, w, y = _data(64, 48, 257, dtype=torch.bfloat16, seed=2)
    y[::4] = 256  # the thin row past V's multiple of 8 (its own GEMM) gets real gradients
    ref = _loss_and_grads(x.float(), w.float(), y, backend="torch")
    one = _loss_and_grads(x, w, y, backend="triton", chunk_size=64)
    fp32 = _loss_and_grads(x, w, y, backend="triton", chunk_size=4)
    bf16 = _loss_and_grads(x, w, y, backend="triton", chunk_size=4,
                           grad_accum_dtype=torch.bfloat16)
    err = lambda g: ((g.float() - ref[2]).norm() / ref[2].norm()).item()
    assert fp32[2].dtype == bf16[2].dtype == torch.bfloat16
    assert err(fp32[2]) <= 1.1 * err(one[2]), (err(fp32[2]), err(one[2]))
    assert 1.3 * err(fp32[2]) < err(bf16[2]) < 3e-2, (err(bf16[2]), err(fp32[2]))
    thin = lambda g: ((g[256:].float() - ref[2][256:]).norm() / ref[2][256:].norm()).item()
    assert thin(bf16[2]) < 3e-2, thin(bf16[2])  # all 16 chunks there too, not the last one
    torch.testing.assert_close(fp32[1], bf16[1])  # dX does not involve the accumulator


def test_fast_default_chunks_amortize_the_fp32_accumulator(monkeypatch):
    """Fast mode's default plan: where the budget gives chunks under FAST_MIN_CHUNK tokens
    (each chunk's dW GEMM reads and writes the fp32 [V, H] accumulator), fewer, equal chunks
    of about that many, the block never larger than the accumulator; explicit chunk_size /
    memory_budget, low_memory and a bf16 accumulator keep the budget's plan."""
    import logitless.triton_kernels.linear_cross_entropy as tlce
    amortized = tlce._amortized_chunk
    assert amortized(8192, 256000, 2304, 2, 1792, True) == 4096   # Gemma-2: 2 x 4096
    assert amortized(16384, 128256, 4096, 2, 3584, True) == 3584  # Llama-3: the budget's
    assert amortized(10000, 151655, 3584, 2, 3072, True) == 3334  # 3 equal chunks
    assert amortized(2000, 256000, 2304, 2, 1792, True) == 2000   # one chunk, no accumulator
    assert amortized(1700, 256000, 2304, 2, 1792, True) == 1792   # one chunk already
    assert amortized(8192, 256000, 2304, 2, 1792, False) == 1792  # bf16 accumulation
    assert amortized(8192, 256000, 64, 2, 96, True) == 128        # capped: 4·V·H bytes
    assert amortized(5000, 256000, 2304, 2, 1792, True) == 2500   # capped, still equal chunks
    assert amortized(8192, 262144, 1152, 2, 1792, True) == 2048   # Gemma-3 1B: 4 x 2048
    seen = []
    real = tlce._fwd_op

    def spy(*args):
        seen.append(args[15])  # chunk
        return real(*args)
    monkeypatch.setattr(tlce, "_fwd_op", spy)
    monkeypatch.setattr(tlce, "FAST_BUDGET", 40 * 100 * 4)  # 40 fp32 tokens at V = 100
    monkeypatch.setattr(tlce, "LOW_MEMORY_BUDGET", 40 * 100 * 4)
    monkeypatch.setattr(tlce, "FAST_MIN_CHUNK", 64)
    x, w, y = _data(150, 128, 100, dtype=torch.float32)  # the cap: H = 128 fp32 tokens
    ref = _loss_and_grads(x, w, y, backend="torch")
    for kw, chunk in (({}, 75), (dict(memory_budget=40 * 100 * 4), 40), (dict(chunk_size=40), 40),
                      (dict(low_memory=True), 40),
                      (dict(grad_accum_dtype=torch.float32), 75)):
        got = _loss_and_grads(x, w, y, backend="triton", **kw)
        assert seen[-1] == chunk, (kw, seen)
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r, rtol=2e-5, atol=2e-6)
    # no dW, no accumulator to amortize: a frozen head and a no-grad call keep the budget's plan
    lt.linear_cross_entropy(x.detach().requires_grad_(), w, y, backend="triton").backward()
    assert seen[-1] == 40
    with torch.no_grad():
        lt.linear_cross_entropy(x, w.detach().requires_grad_(), y, backend="triton")
    assert seen[-1] == 40


def test_triton_argument_errors():
    x, w, y = _data(8, 16, 32)
    with pytest.raises(TypeError, match="low_memory"):
        lt.linear_cross_entropy(x, w, y, backend="triton", low_memory="yes")
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        lt.linear_cross_entropy(x, w, y, backend="triton", grad_accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="block_v"):
        lt.linear_cross_entropy(x, w, y, backend="triton", block_v=100)
    with pytest.raises(TypeError, match="backend='triton' supports"):
        lt.linear_cross_entropy(x.double(), w.double(), y, backend="triton")
    with pytest.raises(TypeError, match="unexpected keyword argument 'blocksize'"):
        lt.linear_cross_entropy(x, w, y, backend="triton", blocksize=3)
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="segment_size"):
            lt.linear_cross_entropy(x, w, y, backend="triton", segment_size=bad)
    with pytest.raises(TypeError, match="row_sync"):
        lt.linear_cross_entropy(x, w, y, backend="triton", row_sync=1)


def test_first_logits_gemm_is_queued_before_the_small_kernels(monkeypatch):
    """The forward queues chunk 0's logits GEMM before the target check and the "mean"
    divisor (~15 small kernels): on a GPU their launches then overlap the GEMM instead of
    delaying it where a call starts on an idle GPU (H100, Llama shape: 1.44 -> ~0.8 ms)."""
    import logitless.triton_kernels.linear_cross_entropy as lce
    from logitless import _torch_common as common
    order = []
    for mod, name in ((lce, "_logits"), (common, "check_targets"),
                      (common, "token_weight_total")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _f=real, **k: (
            order.append(_n), _f(*a, **k))[1])
    x, w, y = _data(40, 16, 50, seed=7)
    got = _loss_and_grads(x, w, y, backend="triton", chunk_size=16)
    assert order[:3] == ["_logits", "check_targets", "token_weight_total"], order
    assert order.count("check_targets") == 1 and order.count("_logits") == 3, order
    ref = _loss_and_grads(x, w, y, backend="torch")
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_no_grad_forward_matches():
    x, w, y = _data(20, 16, 50, seed=3)
    with torch.no_grad():
        a = lt.linear_cross_entropy(x, w, y, backend="triton", reduction="none")
    b = lt.linear_cross_entropy(x, w, y, backend="torch", reduction="none")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(chunk_size=16), dict(reduction="none", chunk_size=16),
                                dict(low_memory=True, chunk_size=16, vocab_chunk_size=32)])
def test_dx_in_row_pieces_equals_whole_chunks(kw):
    """``dx_chunk_size`` issues each chunk's dX GEMM in pieces of rows (5 + 5 + 5 + 1 of a
    16-token chunk, 5 + 2 of the last, 7-token one): the same gradients as whole chunks and as
    backend="torch", in each sweep that computes dX (fast forward, recompute, low-memory)."""
    x, w, y = _data(39, 24, 70, seed=23)
    up = torch.rand(39, generator=torch.Generator().manual_seed(SEED + 24)).to(DEV) \
        if kw.get("reduction") == "none" else None

    def run(**k):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss = lt.linear_cross_entropy(xg, wg, y, **k)
        loss.backward(up)
        return loss.detach(), xg.grad, wg.grad
    ref = run(backend="torch", **{k: v for k, v in kw.items() if k == "reduction"})
    whole = run(backend="triton", **kw)
    got = run(backend="triton", dx_chunk_size=5, **kw)
    for a, b, r in zip(got, whole, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["fast", "low_memory", "none", "own_gemm"])
def test_row_padding_is_loaded_but_never_counted(monkeypatch, case):
    """The row kernel loads and stores each row up to V rounded to 16 (``common.load_cols``;
    vectorized accesses: a V of 50257 ran 2.6x slower on an H100 than 50272). Whatever the
    padding holds must not reach a result: NaN there gives bit-for-bit the results of zeros
    there, with every option that sums over the row (class weights x smoothing, softcap)."""
    n, h, v = 37, 24, 61  # rows padded to 64; low-memory vocabulary chunks of 24 / 13 columns
    dtype = torch.bfloat16 if case == "own_gemm" else torch.float32
    x, w, y = _data(n, h, v, dtype=dtype, seed=21)
    g = torch.Generator().manual_seed(SEED + 22)
    b = torch.randn(v, generator=g).to(DEV, dtype)
    cw = torch.rand(v, generator=g).to(DEV)
    kw = dict(backend="triton", linear_bias=b, weight=cw, softcap=5.0, z_loss=1e-3,
              chunk_size=16, label_smoothing=0.1)
    if case == "low_memory":
        kw.update(low_memory=True, vocab_chunk_size=24)
    elif case == "none":
        kw.update(reduction="none")
    elif case == "own_gemm":
        kw.update(logits_gemm="triton", label_smoothing=0.0)
    up = torch.rand(n, generator=g).to(DEV) if case == "none" else None

    def compute():
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss = lt.linear_cross_entropy(xg, wg, y, **kw)
        loss.backward(up)
        return loss.detach(), xg.grad, wg.grad
    assert_row_padding_never_counted(monkeypatch, compute)


def test_load_cols_stays_inside_every_row():
    from logitless import _torch_common as common
    buf = common.rows_buffer(5, 50257, torch.bfloat16, "cpu")
    assert common.load_cols(50257, buf) == 50272
    assert common.load_cols(100, buf[:, 300:400]) == 112   # a column view: the row goes on
    assert common.load_cols(61, torch.empty(5, 61)) == 61  # unpadded rows
    assert common.load_cols(61, torch.empty(5, 62)[:, :61]) == 61  # 64 would reach the next row
    assert common.load_cols(61, torch.empty(5, 70)[:, :61]) == 64
    assert common.load_cols(61, buf, torch.empty(5, 61)) == 61  # one buffer decides for all
    last = torch.empty(3 * 64 + 61)  # the last row's padding is missing from the storage
    assert common.load_cols(61, torch.as_strided(last, (4, 61), (64, 1))) == 61
    assert common.load_cols(61, torch.as_strided(torch.empty(4 * 64), (4, 61), (64, 1))) == 64
    assert common.load_cols(61, torch.empty(0, 61)) == 64  # no rows, nothing to read


# ----------------------------------------------------------------------------- logits_gemm
def _spy_own_gemm(monkeypatch, record=lambda args, live: args[0].shape[0]):
    """Record each launch of our logits GEMM: its rows, or what ``record(args, live)`` says."""
    import logitless.triton_kernels.logits_gemm as stats_gemm
    calls = []
    real = stats_gemm.logits_with_stats

    def spy(*args, live=None, **kwargs):
        calls.append(record(args, live))
        return real(*args, live=live, **kwargs)
    monkeypatch.setattr(stats_gemm, "logits_with_stats", spy)
    return calls


def _spy_grad_gemm(monkeypatch):
    """Record (rows, first class, classes) of each launch of the dz-epilogue GEMM."""
    import logitless.triton_kernels.logits_gemm as stats_gemm
    calls = []
    real = stats_gemm.logit_grads

    def spy(x, w, col_offset, out, *args, **kwargs):
        calls.append((x.shape[0], col_offset, out.shape[1]))
        return real(x, w, col_offset, out, *args, **kwargs)
    monkeypatch.setattr(stats_gemm, "logit_grads", spy)
    return calls


@pytest.mark.parametrize("dtype,block_v", [(torch.bfloat16, None), (torch.float16, None),
                                           (torch.bfloat16, 16)])
def test_own_logits_gemm_runs_and_equals_the_cublas_path(monkeypatch, dtype, block_v):
    # V not a multiple of 8 (padded rows), 3 token chunks (2 with block_v=16, the slowest
    # test in the interpreter: 65 s of a busy CI run at 3); several row / column / K tiles in
    # the interpreter (16x32x16 tiles; on a GPU 128x256x64: 1 x 2 x 1). With block_v=16 the row
    # kernel folds the GEMM's per-tile statistics 16 tiles at a time: V over 16 tiles (545 in
    # the interpreter's 32-column tiles, 4397 in the GPU's 256-column ones) takes 2 such steps.
    # block16 tests the fold, not the options: fewer tokens (2 chunks) and K tiles, no softcap
    # (tanh is the interpreter's slowest op in the row kernel's 16-column steps, where its time
    # goes), and the cuBLAS reference at the default block
    n = 100 if block_v is None else 52
    h = 64 if block_v is None else 32
    v = 301 if block_v is None else (4397 if CUDA else 545)
    x, w, y = _data(n, h, v, dtype=dtype, seed=11)
    b = torch.randn(v, device=DEV).to(dtype)
    cw = torch.rand(v, device=DEV)
    kw = dict(backend="triton", linear_bias=b, weight=cw, z_loss=1e-3, chunk_size=48,
              softcap=6.0 if block_v is None else None)
    calls = _spy_own_gemm(monkeypatch)
    grad_calls = _spy_grad_gemm(monkeypatch)
    ref = _loss_and_grads(x, w, y, logits_gemm="cublas", **kw)
    kw["block_v"] = block_v
    assert calls == [] and grad_calls == []
    got = _loss_and_grads(x, w, y, logits_gemm="triton", **kw)
    chunks = [48] * (n // 48) + [n % 48]
    assert calls == chunks and grad_calls == []  # the fast forward wrote the gradients
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
    for a, r in zip(got[1:], ref[1:]):
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 2e-3, rel  # summation order only; dz itself is computed identically
    with torch.no_grad():  # the loss-only forward and reduction="none" take it too
        none = lt.linear_cross_entropy(x, w, y, reduction="none", logits_gemm="triton", **kw)
    assert len(calls) == 2 * len(chunks)
    torch.testing.assert_close(none.sum() / cw[y.clamp_min(0)][y != -100].sum(), ref[0],
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype,reduction,low_memory", [(torch.bfloat16, "mean", True),
                                                        (torch.float16, "none", False)])
def test_own_gemm_recomputes_dz_in_its_epilogue(monkeypatch, dtype, reduction, low_memory):
    """The recomputing sweeps (low-memory mode's vocabulary sweep; reduction="none" and lse
    gradients in the token sweep) take dz from the GEMM's epilogue: no logits block, no row
    pass, the results of cuBLAS + the row kernel. Every option but smoothing, a ragged last
    chunk of each sweep, V not a multiple of 8, an ignored and a zero-weight target. Inputs on
    a grid (x on 1/64, W on 1/8): every x·Wᵀ is exact in fp32 whatever the summation order,
    so both GEMMs round the logits alike. (With Gaussian inputs our GEMM and the CPU's summed
    in different orders, and a logit rounded one fp16 ulp apart moved a token's loss by
    2.9e-4 relative, seed 1412289904.)"""
    n, h, v = 70, 64, 301
    _, _, y = _data(n, h, v, dtype=dtype, seed=31)
    grid = torch.Generator().manual_seed(SEED + 33)
    x = (torch.randint(-64, 65, (n, h), generator=grid) / 64).to(DEV, dtype)
    w = (torch.randint(-2, 3, (v, h), generator=grid) / 8).to(DEV, dtype)
    y[3] = -100
    g = torch.Generator().manual_seed(SEED + 32)
    b = torch.randn(v, generator=g).to(DEV, dtype)
    cw = torch.rand(v, generator=g).to(DEV)
    cw[y[5]] = 0.0
    up = torch.rand(n, generator=g).to(DEV) if reduction == "none" else None
    if up is not None:
        up[3] = float("inf")  # at the ignored token: its gradient is 0 all the same
    up_lse = torch.randn(n, generator=g).to(DEV)

    def run(gemm, low_memory):
        xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
        loss, lse = lt.linear_cross_entropy(
            xg, wg, y, linear_bias=bg, weight=cw, softcap=6.0, z_loss=1e-3, backend="triton",
            reduction=reduction, return_lse=True, chunk_size=32, vocab_chunk_size=120,
            low_memory=low_memory, logits_gemm=gemm)
        torch.autograd.backward([loss, lse], [torch.ones_like(loss) if up is None else up,
                                              up_lse])
        return loss.detach(), xg.grad, wg.grad, bg.grad

    ref = run("cublas", low_memory)
    calls = _spy_grad_gemm(monkeypatch)
    got = run("triton", low_memory)
    sweep = [(32, 0, v), (32, 0, v), (6, 0, v)]  # the token sweep: dX (and dW, fast)
    if low_memory:  # then the vocabulary sweep: dW and db
        sweep += [(n, 0, 120), (n, 120, 120), (n, 240, 61)]
    assert calls == sweep
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0, equal_nan=True)
    for a, r in zip(got[1:], ref[1:]):
        assert torch.isfinite(a).all()
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 2e-3, rel  # summation order only


@pytest.mark.parametrize("v", [248, 301])
@pytest.mark.parametrize("gemm", ["cublas", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_joins_the_logits_in_fp32_after_one_rounding(dtype, gemm, v):
    """The loss sees round(x·Wᵀ) + b, the bias added in fp32. On an H100 cuBLAS rounded twice,
    round(round(x·Wᵀ) + b), when it added the bias into our strided logits buffers (V = 248:
    rows padded to 256; V = 301: the split at the 8-aligned 296): ~30% of the logits one
    rounding off, twice the naive path's gradient error. Inputs on a 1/64 grid with small
    integer weights: every x·Wᵀ is exact in fp32 whatever the summation order, so rounding it
    to the input dtype has one right answer, and the bias's bits make a second rounding show."""
    g = torch.Generator().manual_seed(SEED + 17)
    n, h = 40, 64
    x = (torch.randint(-128, 128, (n, h), generator=g) / 64).to(DEV, dtype)
    w = torch.randint(-2, 3, (v, h), generator=g).to(DEV, dtype)
    b = (torch.randn(v, generator=g) * 3).to(DEV, dtype)
    y = torch.randint(0, v, (n,), generator=g).to(DEV)
    with torch.no_grad():
        got = lt.linear_cross_entropy(x, w, y, linear_bias=b, reduction="none", backend="triton",
                                      logits_gemm=gemm, chunk_size=16)
    z = (x.double() @ w.double().t()).to(dtype).double() + b.double()
    want = torch.logsumexp(z, 1) - z[torch.arange(n), y]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("masked", [slice(60, None), slice(0, 40)])
@pytest.mark.parametrize("kw", [{}, dict(logits_gemm="triton"), dict(block_v=16)],
                         ids=["default", "own-gemm", "block16"])
def test_vocabulary_masked_by_minus_inf_bias(kw, masked):
    """A -inf bias over whole row blocks / GEMM column tiles (a padded or forbidden part of
    the vocabulary): finite loss and gradients equal to backend="torch" (the online Σexp
    once gave exp(-inf - (-inf)) = NaN there)."""
    x, w, _ = _data(6, 16, 100, dtype=torch.bfloat16, seed=13)
    b = torch.zeros(100, device=DEV, dtype=torch.bfloat16)
    b[masked] = float("-inf")
    y = torch.arange(6, device=DEV) + (0 if masked.start else 60)  # targets never masked
    bb = b.clone().requires_grad_()
    got = _loss_and_grads(x, w, y, backend="triton", linear_bias=bb, chunk_size=4, **kw)
    db = bb.grad
    bb = b.clone().requires_grad_()
    want = _loss_and_grads(x, w, y, backend="torch", linear_bias=bb)
    for a, r in zip(got + (db,), want + (bb.grad,)):
        assert torch.isfinite(a.float()).all()
        # norm-wise: elementwise bounds trip on cancelling sums rounded to bf16 (seen on GPU)
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 1e-2, rel


@pytest.mark.parametrize("softcap", [30.0, 1e3, 1e6, 1e8])
@pytest.mark.parametrize("kw", [{}, dict(low_memory=True, vocab_chunk_size=32),
                                dict(logits_gemm="triton")], ids=["fast", "low-memory", "own-gemm"])
def test_softcap_far_above_the_logits_stays_accurate(kw, softcap):
    """Logits of |z| < 10 under a softcap far above them: capping is then nearly the identity.
    fp32 must give the float64 result to fp32's accuracy; our GEMM (bf16/fp16 only) must be as
    close to it as backend="torch" (the same bf16 logits, capped by torch.tanh). tanh as
    (1 − e^(−2|u|)) / (1 + e^(−2|u|)) cancelled for small u: every capped logit was off by
    ~softcap·3e-8 (relative errors 3e-4 at softcap 1e5, 0.3 at 1e8)."""
    from logitless.specs import linear_cross_entropy as spec
    own = "logits_gemm" in kw
    x, w, y = _data(12, 16, 70, dtype=torch.bfloat16 if own else torch.float32, seed=21)
    got = _loss_and_grads(x, w, y, backend="triton", reduction="sum", softcap=softcap,
                          chunk_size=8, **kw)
    rel = lambda a, r: ((a.double().cpu() - r.double().cpu()).norm() / r.double().cpu().norm()
                        ).item()
    ref = spec.reference(x.double().cpu().numpy(), w.double().cpu().numpy(), y.cpu().numpy(),
                         options=spec.LinearCrossEntropyOptions(reduction="sum",
                                                                softcap=softcap))
    want = [torch.as_tensor(np.asarray(ref[k])) for k in ("loss", "dx", "dw")]
    if own:
        # As accurate against float64 as backend="torch" (the same bf16 logits, capped by
        # torch.tanh). Not equal to it: the two tanh forms differ in the last fp32 bits, which
        # flips the bf16 rounding of a few dz (seen: 3 of 192 dX elements one ulp apart, 1.2e-3
        # norm-wise). The loss, fp32 from the same logits, carries the cancellation's error.
        torch_errs = [rel(a, r) for a, r in zip(
            _loss_and_grads(x, w, y, backend="torch", reduction="sum", softcap=softcap), want)]
        tols = [1.25 * e + 1e-5 for e in torch_errs]
    else:
        tols = [2e-6] * 3
    for a, r, tol, key in zip(got, want, tols, ("loss", "dx", "dw")):
        err = rel(a, r)
        assert err < tol, (key, err, tol)


def test_logits_gemm_errors():
    x, w, y = _data(8, 64, 40, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="logits_gemm must be one of"):
        lt.linear_cross_entropy(x, w, y, backend="triton", logits_gemm="cutlass")
    with pytest.raises(ValueError, match="logits_gemm must be one of"):
        lt.linear_cross_entropy(x, w, y, backend="triton", logits_gemm=True)
    with pytest.raises(ValueError, match="label smoothing"):
        lt.linear_cross_entropy(x, w, y, backend="triton", logits_gemm="triton",
                                label_smoothing=0.1)
    with pytest.raises(ValueError, match="bfloat16/float16 inputs only"):
        lt.linear_cross_entropy(x.float(), w.float(), y, backend="triton", logits_gemm="triton")
    x33, w33, y33 = _data(8, 33, 40, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="input must be row-major with 16-byte aligned rows"):
        lt.linear_cross_entropy(x33, w33, y33, backend="triton", logits_gemm="triton")
    x_off = torch.zeros(8, 72, device=DEV, dtype=torch.bfloat16)[:, 4:68]  # 8 bytes in
    x_off.copy_(x)
    with pytest.raises(ValueError, match="input must start at a 16-byte aligned address"):
        lt.linear_cross_entropy(x_off, w, y, backend="triton", logits_gemm="triton")
    lt.linear_cross_entropy(x[:0], w, y[:0], backend="triton", logits_gemm="triton")  # no GEMM
    w_t = w.t().contiguous().t()  # a transposed tied embedding: column-major
    with pytest.raises(ValueError, match="linear_weight must be row-major"):
        lt.linear_cross_entropy(x, w_t, y, backend="triton", logits_gemm="triton")
    for xx, ww, yy in ((x33, w33, y33), (x, w_t, y), (x.float(), w.float(), y)):
        lt.linear_cross_entropy(xx, ww, yy, backend="triton", label_smoothing=0.1)  # cuBLAS


def test_logits_gemm_auto_rule(monkeypatch):
    """"auto" resolves to our GEMM for the low-memory setting on a Hopper GPU where its layout
    checks pass, to cuBLAS otherwise; an explicit "triton" on a bad layout raises instead."""
    import logitless.triton_kernels.linear_cross_entropy as lce
    codes = lce.LOGITS_GEMM

    class Stub:  # only what the rule reads
        def __init__(self, is_cuda, n=4):
            self.is_cuda, self.shape, self.device = is_cuda, (n, 8), "cuda:0"

    why = {"reason": ""}
    cap = {"cc": (9, 0)}
    monkeypatch.setattr(lce.stats_gemm, "unsupported_layout", lambda x, w, b: why["reason"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["cc"])
    resolve = lambda code, x, low: lce._resolve_gemm(codes[code], x, None, None, low)
    assert resolve("auto", Stub(True), True) == codes["triton"]
    assert resolve("auto", Stub(True), False) == codes["cublas"]
    assert resolve("auto", Stub(False), True) == codes["cublas"]  # the interpreter: torch.mm
    assert resolve("auto", Stub(True, n=0), True) == codes["cublas"]
    assert resolve("cublas", Stub(True), True) == codes["cublas"]
    assert resolve("triton", Stub(True), False) == codes["triton"]
    cap["cc"] = (10, 0)  # measured on Hopper only: "auto" stays with cuBLAS elsewhere
    assert resolve("auto", Stub(True), True) == codes["cublas"]
    assert resolve("triton", Stub(True), True) == codes["triton"]
    cap["cc"] = (9, 0)
    why["reason"] = "input must be row-major"
    assert resolve("auto", Stub(True), True) == codes["cublas"]
    with pytest.raises(ValueError, match="cannot run here: input must be row-major"):
        resolve("triton", Stub(True), True)


@pytest.mark.parametrize("low_memory", [True, False])
def test_logits_gemm_default(monkeypatch, low_memory):
    """The default ("auto") runs our GEMM exactly where the rule says (low-memory on a GPU;
    the fast setting and the interpreter: cuBLAS), with cuBLAS's results, and falls back to
    cuBLAS without an error where ours cannot run (smoothing, an unaligned layout).
    (skip_ignored off: on a Hopper GPU its "auto" runs our plain GEMM in the fast setting;
    its own tests are below.)"""
    n, h, v = 40, 64, 173  # ragged token and vocabulary chunks (128 + 45 classes)
    x, w, y = _data(n, h, v, dtype=torch.bfloat16, seed=41)
    kw = dict(backend="triton", low_memory=low_memory, chunk_size=16, vocab_chunk_size=128,
              skip_ignored=False)
    calls = _spy_own_gemm(monkeypatch)
    grad_calls = _spy_grad_gemm(monkeypatch)
    ref = _loss_and_grads(x, w, y, logits_gemm="cublas", **kw)
    got = _loss_and_grads(x, w, y, **kw)
    own = low_memory and x.is_cuda and torch.cuda.get_device_capability()[0] == 9
    assert (len(calls) > 0) == own and (len(grad_calls) > 0) == own, (calls, grad_calls)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
    for a, r in zip(got[1:], ref[1:]):
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 2e-3, rel
    calls.clear()
    grad_calls.clear()
    x33, w33, y33 = _data(8, 33, 40, dtype=torch.bfloat16)
    _loss_and_grads(x33, w33, y33, **kw)  # rows not 16-byte aligned
    _loss_and_grads(x, w, y, label_smoothing=0.1, **kw)
    assert calls == [] and grad_calls == []


# ----------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size,logits_gemm", [(None, "cublas"), (20000, "cublas"),
                                                    (20000, "triton"), (20000, "auto")])
def test_64bit_indexing_matches_torch_backend(chunk_size, logits_gemm):
    # N·V = 2.57e9 > 2^31; with chunk_size=N one logits buffer holds all of them, so the
    # kernel's row offsets pass 2^31 and must be 64-bit. ("cublas" turns skip_ignored's
    # "auto" off; "triton" and "auto" skip the ignored 20% on a Hopper GPU, through the
    # statistics GEMM and the plain one.)
    n, h, v = 20000, 64, 128256
    x, w, y = _data(n, h, v, dtype=torch.bfloat16, seed=4)
    y[-1] = v - 1  # the very last logit is a target
    got = _loss_and_grads(x, w, y, backend="triton", chunk_size=chunk_size, reduction="sum",
                          logits_gemm=logits_gemm)
    ref = _loss_and_grads(x, w, y, backend="torch", reduction="sum")
    torch.testing.assert_close(got[0], ref[0], rtol=2e-4, atol=0)
    for a, b in zip(got[1:], ref[1:]):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 1e-2, rel


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend, low_memory", [("triton", False), ("triton", True),
                                                 ("torch", False)])
def test_cuda_graph_training_step(backend, low_memory):
    g = torch.Generator().manual_seed(SEED)
    n, h, v = 512, 128, 4099
    head = torch.nn.Linear(h, v, bias=False, device="cuda")
    tuning = dict(low_memory=low_memory) if backend == "triton" else dict(chunk_size=200)
    check_cuda_graph_training(head, lambda w, hidden, y: lt.linear_cross_entropy(
        hidden, w, y, backend=backend, z_loss=1e-4, **tuning),
        graph_batches(n, h, v, dtype=torch.float32, generator=g))


def test_split_row_wait_timeout_poisons_instead_of_hanging():
    """A one-launch split whose segments can never meet (one program, two segments per row)
    comes back after MAX_SPIN polls with every loss, lse and gradient entry NaN (later rows
    see the abort flag and give up at once), over partials that would give finite results:
    never a hang, never finite and wrong. Also a row's segment 1 taken before its segment 0
    after an abort. CPU: the Triton interpreter, which runs programs one after another."""
    from logitless.triton_kernels import cross_entropy_rows as rows_mod
    rows, v, seg = 2, 64, 32
    g = torch.Generator().manual_seed(SEED)
    z = torch.randn(rows, v, generator=g).to(DEV)
    y = torch.tensor([3, 40], device=DEV)
    one = torch.ones(1, device=DEV)

    def launch(n_rows, buf, lse, loss, sync, write_grad):
        part = torch.zeros(n_rows, 2, rows_mod.NUM_PARTS, device=DEV)
        part[:, :, 1] = 1.0  # Σexp 1 at max 0: plausible stale statistics
        rows_mod.cross_entropy_rows_kernel[(1,)](
            buf, v, one, y.to(DEV), one, one, lse, loss, one, 0, one, n_rows, v, v, 0, v, -100,
            0.0, 0.0, 1.0, one, one, 0, part, sync, seg, one, COMPUTE_LSE=True,
            WRITE_GRAD=write_grad, FROM_TILES=False, HAS_CW=False, SMOOTH=False, HAS_Z=False,
            HAS_SOFTCAP=False, HAS_H=False, HAS_BIAS=False, BLOCK_V=16, SEGS=2, SEGS_P2=2,
            PHASE=rows_mod.FUSED, MAX_SPIN=1000)

    buf = z.clone()
    lse, loss = torch.zeros(rows, device=DEV), torch.zeros(rows, device=DEV)
    sync = torch.zeros(2 + rows, dtype=torch.int32, device=DEV)
    launch(rows, buf, lse, loss, sync, True)
    assert torch.isnan(loss).all() and torch.isnan(lse).all() and torch.isnan(buf).all()
    assert sync[1].item() == 1  # the abort flag

    lse, loss = torch.zeros(1, device=DEV), torch.zeros(1, device=DEV)
    sync = torch.tensor([1, 1, 0], dtype=torch.int32, device=DEV)  # next: (row 0, segment 1)
    launch(1, z.clone(), lse, loss, sync, False)
    sync[0] = 0  # then (row 0, segment 0), which stores the loss
    launch(1, z.clone(), lse, loss, sync, False)
    assert torch.isnan(loss).all() and torch.isnan(lse).all(), (loss, lse)


def test_split_rows_one_launch_merges_what_its_segments_left():
    """The one-launch form's way through (the GPU's default), with one program (interpreted
    or on a GPU), which takes every (row, segment) ticket in order, each row's counter preset one arrival
    short so that no segment waits (the partials of the others come from a first STATS
    launch, as the segments running beside it on a GPU would leave them). Loss, lse and dz
    match torch's, with the target in a middle segment, one in the last (ragged) one, an
    ignored row of very negative logits (e^(-150) underflows fp32: the merge's reference
    point is the row max, never 0), and the row max in the last segment."""
    import torch.nn.functional as F
    from logitless.triton_kernels import cross_entropy_rows as rows_mod
    rows, v, seg, segs = 4, 70, 32, 3
    g = torch.Generator().manual_seed(SEED + 3)
    z = torch.randn(rows, v, generator=g)
    z[3, 69] = 9.0
    z[2] -= 150.0  # e^(-150) underflows fp32: the merge's reference is the row max, never 0
    y = torch.tensor([40, 69, -100, 5])
    one = torch.ones(1, device=DEV)
    lse, loss = torch.zeros(rows, device=DEV), torch.zeros(rows, device=DEV)
    part = torch.full((rows, segs, rows_mod.NUM_PARTS), float("nan"), device=DEV)
    buf = z.clone().to(DEV)  # (on CPU .to would return z itself)

    def launch(phase, sync, write_grad):
        rows_mod.cross_entropy_rows_kernel[(1,)](
            buf, v, one, y.to(DEV), one, one, lse, loss, one, 0, one, rows, v, v, 0, v, -100,
            0.0, 0.0, 1.0, one, one, 0, part, sync, seg, one, COMPUTE_LSE=True,
            WRITE_GRAD=write_grad, FROM_TILES=False, HAS_CW=False, SMOOTH=False, HAS_Z=False,
            HAS_SOFTCAP=False, HAS_H=False, HAS_BIAS=False, BLOCK_V=16, SEGS=segs, SEGS_P2=4,
            PHASE=phase, MAX_SPIN=10)

    launch(rows_mod.STATS, torch.zeros(1, dtype=torch.int32, device=DEV), False)
    sync = torch.zeros(2 + rows, dtype=torch.int32, device=DEV)
    sync[2:] = segs - 1
    with np.errstate(over="ignore", invalid="ignore"):  # masked lanes of row 2: e^(0 + 150)
        launch(rows_mod.FUSED, sync, True)
    assert sync[1].item() == 0 and sync[0].item() >= rows * segs  # no abort; every ticket
    ref = z.double().requires_grad_()
    ref_loss = F.cross_entropy(ref, y, reduction="none", ignore_index=-100)
    ref_loss.sum().backward()
    torch.testing.assert_close(loss.cpu().double(), ref_loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(z.double(), 1), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(buf.cpu().double(), ref.grad, rtol=1e-5, atol=1e-6)


def test_split_layout_follows_block_v_and_caps_segments():
    """Launch settings of split rows: a given block_v sets the segments (whole blocks) and the
    warps (one per 1024 columns, at least 2); a split that rounds to one segment takes the
    whole-row settings; tiny segments are capped at MAX_SEGMENTS per row; never with the own
    GEMM's statistics, nor for a gradient pass."""
    import logitless.triton_kernels.linear_cross_entropy as lce
    cfg = lambda **k: lce.Config(chunk=1, vocab_chunk=1, **{"block_v": 0, "num_warps": 0, **k})
    v = 128256
    assert lce._layout(cfg(), v, True, None, True) == (
        lce.SPLIT_BLOCK, lce.ROW_SEGMENT, -(-v // lce.ROW_SEGMENT), lce.SPLIT_WARPS,
        lce.SPLIT_PROGRAMS_PER_SM)
    assert lce._layout(cfg(block_v=32768), v, True, None, True)[1:4] == (32768, 4, 32)
    assert lce._layout(cfg(block_v=4096, num_warps=8), v, True, None, True)[1:4] == (8192, 16, 8)
    whole = lce._layout(cfg(block_v=16384), 10000, True, None, True)
    assert whole == (16384, 10000, 1, 32 if 10000 >= lce.LONG_ROW else 8, lce.PROGRAMS_PER_SM)
    block, seg, segs, _, _ = lce._layout(cfg(block_v=16, segment=16), v, True, None, True)
    assert segs <= lce.MAX_SEGMENTS and seg % block == 0 and seg * segs >= v
    for args in ((v, True, (None, None), True), (v, False, None, True), (v, True, None, False)):
        assert lce._layout(cfg(), *args)[2] == 1, args  # tiles, gradient pass, interpreted
    assert lce._layout(cfg(segment=32, block_v=16), 97, True, None, False)[1:3] == (32, 4)
    assert lce._layout(cfg(segment=32), 97, True, None, False)[2] == 1  # 128-column block


def test_split_rows_launch_plan_on_a_faked_gpu(monkeypatch):
    """_rows' choice between one launch and two, which the interpreter never makes (it has
    no SM count): on a GPU one launch (FUSED, a zeroed ticket / abort / per-row counter
    buffer) only with row_sync and no more segments than SMs, else STATS (no gradient) then
    GRAD; the partials sized to the segments, SEGS_P2 their power of 2. The kernel is faked
    (it records its arguments), and so is the GPU: a CPU tensor that says it is on CUDA."""
    import types
    import logitless.triton_kernels.linear_cross_entropy as lce
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, STAGES, **meta):
                part, sync, seg_cols = args[-4:-1]  # (then live_ptr)
                launches.append(((meta["PHASE"], meta["WRITE_GRAD"], meta["SEGS"],
                                  meta["SEGS_P2"], seg_cols), tuple(part.shape), sync.tolist()))
            return run

    class FakeCuda(torch.Tensor):
        is_cuda = property(lambda self: True)

    sms = [4]
    monkeypatch.setattr(lce, "cross_entropy_rows_kernel", Kernel())
    monkeypatch.setattr(lce, "_interpret", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(multi_processor_count=sms[0]))
    n, v = 3, 40
    buf = torch.zeros(n, v).as_subclass(FakeCuda)

    def plan(segment, row_sync=True):
        launches.clear()
        cfg = lce.Config(chunk=n, vocab_chunk=v, block_v=8, num_warps=0, segment=segment,
                         row_sync=row_sync)
        lce._rows(buf, None, n, v, 0, torch.zeros(n, dtype=torch.long), None, None,
                  torch.zeros(n), torch.zeros(n), torch.ones(1), None, (-100, 0.0, 0.0, None),
                  v, cfg, True, True)
        return [k[0] for k in launches]

    F, S, G = lce.FUSED, lce.STATS, lce.GRAD
    assert plan(12) == [(F, True, 3, 4, 16)]  # 12 -> two 8-column blocks; 3 segments
    assert launches[0][1:] == ((n, 3, lce.NUM_PARTS), [0] * (2 + n))
    assert plan(12, row_sync=False) == [(S, False, 3, 4, 16), (G, True, 3, 4, 16)]
    assert launches[0][1] == (n, 3, lce.NUM_PARTS)
    sms[0] = 2  # 3 segments of a row, 2 SMs: they might never all run at once
    assert plan(12) == [(S, False, 3, 4, 16), (G, True, 3, 4, 16)]
    sms[0] = 4
    assert plan(24) == [(F, True, 2, 2, 24)] and launches[0][2] == [0] * (2 + n)
    assert plan(0) == [(F, True, 1, 2, v)]  # 8192-column default: whole rows


def test_split_row_kernel_compiles_for_sm90():
    """The interpreter neither compiles nor runs the one-launch split's waits (two launches
    there): compile every form of the row kernel for an H100 (no GPU needed; the interpreter
    accepted module globals and names bound in constexpr branches that the compiler refuses),
    in a clean process (no TRITON_INTERPRET)."""
    import os
    import subprocess
    import sys
    code = (
        "from logitless.triton_kernels.cross_entropy_rows import compile_variants\n"
        "print(compile_variants(90))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("variant")]
    assert len(lines) >= 8 and all(ln.endswith(" ok") for ln in lines), r.stdout


def _spy_row_phases(monkeypatch):
    """The PHASE of every split row-kernel launch (whole rows not recorded)."""
    import logitless.triton_kernels.linear_cross_entropy as lce
    phases, real = [], lce._launch_rows

    def spy(launch, key, **meta):
        if launch.keywords["SEGS"] > 1:
            phases.append(meta["PHASE"])
        return real(launch, key, **meta)
    monkeypatch.setattr(lce, "_launch_rows", spy)
    return phases


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, class_weights=True,
                                              bias=True, softcap=20.0, z_loss=1e-3)])
def test_gpu_split_rows_one_launch_equals_two_and_whole_rows(monkeypatch, options):
    """Long rows split over programs: the one-launch form (segments waiting for each other)
    gives exactly what two launches give (the same partials, merged alike), and the whole-row
    kernel's results up to the order of the sums; the default (GPU) splits V = 50257 into 7
    segments, 4 given; fp32 logits and bf16 ones, several chunks."""
    from logitless.triton_kernels import cross_entropy_rows as rows_mod
    n, h, v = 300, 64, 50257
    for dtype in (torch.float32, torch.bfloat16):
        x, w, y = _data(n, h, v, dtype=dtype, seed=61)
        g = torch.Generator().manual_seed(SEED + 62)
        kw = dict(backend="triton", chunk_size=128, label_smoothing=options.get(
            "label_smoothing", 0.0), z_loss=options.get("z_loss", 0.0),
            softcap=options.get("softcap"))
        if options.get("bias"):
            kw["linear_bias"] = torch.randn(v, generator=g).to(DEV, dtype)
        if options.get("class_weights"):
            kw["weight"] = torch.rand(v, generator=g).to(DEV)
        phases = _spy_row_phases(monkeypatch)
        one = _loss_and_grads(x, w, y, **kw)
        assert phases and set(phases) == {rows_mod.FUSED}, phases  # one launch each
        phases.clear()
        two = _loss_and_grads(x, w, y, row_sync=False, **kw)
        assert {rows_mod.STATS, rows_mod.GRAD} <= set(phases), phases
        for a, b in zip(one, two):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        four = _loss_and_grads(x, w, y, segment_size=16384, **kw)
        whole = _loss_and_grads(x, w, y, segment_size=v, **kw)
        for got in (one, four):
            torch.testing.assert_close(got[0], whole[0], rtol=1e-5, atol=1e-6)
            for a, r in zip(got[1:], whole[1:]):
                rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
                assert rel < (1e-5 if dtype == torch.float32 else 5e-3), rel


def test_row_stages_fall_back_where_their_buffers_do_not_fit(monkeypatch):
    """The row loops' software pipeline keeps (stages - 1) copies of each block's loads in
    shared memory (256 KiB for fp32 rows of 32K columns, 128 KiB for bf16: more than an
    L4's 99 KiB): where Triton refuses a launch for it, the kernel runs unpipelined, and that
    launch configuration remembers it."""
    import logitless.triton_kernels.linear_cross_entropy as lce
    from triton.runtime.errors import OutOfResources
    assert lce.ROW_STAGES > 1
    launches = []

    class Kernel:  # refuses pipelined launches as Triton does (before running anything)
        def __getitem__(self, grid):
            def run(*args, STAGES, **meta):
                launches.append((STAGES, meta["HAS_BIAS"]))
                if STAGES > 1:
                    raise OutOfResources(256 << 10, 227 << 10, "shared memory")
            return run
    monkeypatch.setattr(lce, "cross_entropy_rows_kernel", Kernel())
    monkeypatch.setattr(lce, "_interpret", lambda: False)
    monkeypatch.setattr(lce, "_ROW_STAGES_FITTING", {})
    n, v = 3, 40
    buf = torch.zeros(n, v)
    f32 = lambda *shape: torch.zeros(*shape)
    cfg = lce.Config(chunk=n, vocab_chunk=v, block_v=0, num_warps=0)

    def rows(bias):
        lce._rows(buf, bias, n, v, 0, torch.zeros(n, dtype=torch.long), None, None, f32(n),
                  f32(n), torch.ones(1), None, (-100, 0.0, 0.0, None), v, cfg, True, True)
    rows(None)
    assert launches == [(lce.ROW_STAGES, False), (1, False)]
    rows(None)  # remembered: no second refusal
    assert launches[2:] == [(1, False)]
    rows(f32(v))  # another launch configuration tries again
    assert launches[3:] == [(lce.ROW_STAGES, True), (1, True)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,options", [
    (torch.float32, {}),
    (torch.bfloat16, dict(label_smoothing=0.1, bias=True, class_weights=True)),
    (torch.float16, dict(bias=True))])
def test_long_rows_in_every_dtype_and_option_launch(dtype, options):
    """Rows of 32K-column blocks whose pipelined loads would not fit shared memory (fp32
    logits; class weights and bias loaded beside bf16 ones) run, with the torch backend's
    results."""
    n, h, v = 48, 64, 50257
    x, w, y = _data(n, h, v, dtype=dtype, seed=51)
    g = torch.Generator().manual_seed(SEED + 52)
    kw = dict(label_smoothing=options.get("label_smoothing", 0.0))
    if options.get("bias"):
        kw["linear_bias"] = torch.randn(v, generator=g).to(DEV, dtype)
    if options.get("class_weights"):
        kw["weight"] = torch.rand(v, generator=g).to(DEV)
    got = _loss_and_grads(x, w, y, backend="triton", **kw)
    ref = _loss_and_grads(x, w, y, backend="torch", **kw)
    # half-precision logits: the two backends' GEMMs (different token chunks) may round a
    # logit differently, and the target logit's rounding does not average out over 48 tokens
    # (bf16 + bias + smoothing + class weights, seed 660776903: 1.37e-4 on the H100)
    rtol = {torch.float32: 1e-4, torch.float16: 2e-4, torch.bfloat16: 1e-3}[dtype]
    torch.testing.assert_close(got[0], ref[0], rtol=rtol, atol=1e-5)
    for a, r in zip(got[1:], ref[1:]):
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < (1e-4 if dtype == torch.float32 else 1e-2), rel

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("low_memory", [False, True])
def test_cuda_graph_training_step_own_logits_gemm(monkeypatch, low_memory):
    # the GEMM's tensor descriptors are built on the host at launch: captured, then replayed
    g = torch.Generator().manual_seed(SEED)
    n, h, v = 512, 128, 4099
    head = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16)
    calls = _spy_own_gemm(monkeypatch)
    check_cuda_graph_training(head, lambda w, hidden, y: lt.linear_cross_entropy(
        hidden, w, y, backend="triton", low_memory=low_memory, z_loss=1e-4,
        logits_gemm="triton"), graph_batches(n, h, v, dtype=torch.bfloat16, generator=g))
    assert calls


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_no_host_sync(reduction, low_memory):
    x, w, y = _data(300, 64, 1000, dtype=torch.bfloat16, seed=5)
    x.requires_grad_()
    w.requires_grad_()
    lt.linear_cross_entropy(x, w, y, backend="triton").sum().backward()  # compile outside
    with no_host_sync():
        loss = lt.linear_cross_entropy(x, w, y, backend="triton", reduction=reduction,
                                       low_memory=low_memory, label_smoothing=0.1,
                                       weight=torch.rand(1000, device="cuda"))
        loss.sum().backward()
    assert torch.isfinite(x.grad.float()).all()
    lt.linear_cross_entropy(x, w, y, backend="triton", logits_gemm="triton").sum().backward()
    with no_host_sync():  # the own logits GEMM (no smoothing)
        loss = lt.linear_cross_entropy(x, w, y, backend="triton", reduction=reduction,
                                       low_memory=low_memory, logits_gemm="triton",
                                       weight=torch.rand(1000, device="cuda"))
        loss.sum().backward()


@gpu
@pytest.mark.gpu
def test_transposed_tied_head_is_not_copied():
    """A tied embedding stored (H, V) and passed as its transpose costs no weight-sized copy:
    fwd+bwd peaks within a quarter of V·H·2 bytes of the same call on a contiguous head."""
    g = torch.Generator().manual_seed(SEED)
    n, h, v = 1024, 1024, 32000
    x = torch.randn(n, h, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    emb = (torch.randn(h, v, generator=g) * 0.02).to("cuda", torch.bfloat16)  # (H, V)
    y = torch.randint(0, v, (n,), generator=g).cuda()

    def peak(w):
        w = w.requires_grad_()
        torch.autograd.grad(lt.linear_cross_entropy(x, w, y, backend="triton"), (x, w))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(lt.linear_cross_entropy(x, w, y, backend="triton"), (x, w))
        torch.cuda.synchronize()
        assert grads[1].shape == (v, h)
        return torch.cuda.max_memory_allocated() - base

    transposed, dense = peak(emb.t()), peak(emb.t().contiguous())
    assert transposed - dense < 0.25 * v * h * 2, (transposed, dense)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_backend_no_host_sync(reduction):
    """The README's claim holds for backend="torch" on CUDA too (chunked, recomputing)."""
    x, w, y = _data(300, 64, 1000, dtype=torch.bfloat16, seed=6)
    x.requires_grad_()
    w.requires_grad_()
    kw = dict(backend="torch", chunk_size=128, reduction=reduction, label_smoothing=0.1,
              z_loss=1e-4, return_lse=True, weight=torch.rand(1000, device="cuda"))
    loss, lse = lt.linear_cross_entropy(x, w, y, **kw)
    (loss.sum() + lse.sum()).backward()  # kernels compiled, workspaces made, outside
    with no_host_sync():
        loss, lse = lt.linear_cross_entropy(x, w, y, **kw)
        (loss.sum() + lse.sum()).backward()
    assert torch.isfinite(x.grad.float()).all()


@gpu
@pytest.mark.gpu
def test_out_of_range_target_is_an_error_on_gpu():
    # device-side assert: checked in a subprocess, since it poisons the CUDA context
    import subprocess
    import sys
    code = (
        "import torch, logitless.torch as lt\n"
        "x=torch.randn(4,8,device='cuda'); w=torch.randn(10,8,device='cuda')\n"
        "y=torch.tensor([1,2,10,3],device='cuda')\n"
        "print(lt.linear_cross_entropy(x,w,y,backend='triton').item())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0
    assert "assert" in (r.stderr + r.stdout).lower()


def test_in_place_narrowing_never_writes_what_a_later_program_reads(monkeypatch):
    """narrow_ writes the fp32 accumulator's values as 2-byte ones over its own storage: a
    launch that narrows elements [start, stop) writes fp32 slots [start/2, stop/2), which must
    all have been read already (by earlier launches, in stream order) unless the launch is the
    single-program one that reads before it writes. On a GPU an overlap is a race the
    interpreter (programs one after another) never shows, so the schedule is checked as is."""
    from logitless.triton_kernels import narrow_cast
    calls = []
    monkeypatch.setattr(narrow_cast, "_launch",
                        lambda src, dst, scale, start, stop, interpret, sync=False:
                        calls.append((src.data_ptr(), dst.data_ptr(), start, stop, sync)))
    n_a, n_b = 3 * narrow_cast.FIRST + 5, 2 * narrow_cast.FIRST + 3
    a, b = torch.zeros(n_a), torch.zeros(n_b)
    narrow_cast.narrow_(a, b, None, torch.bfloat16, True)
    *own, last = calls
    assert own[0][2:] == (0, narrow_cast.FIRST, True)
    assert all(c[:2] == (a.data_ptr(), a.data_ptr()) for c in own)
    assert [c[2] for c in own[1:]] == [c[3] for c in own[:-1]] and own[-1][3] == n_a  # tiles
    assert all(not sync and stop <= 2 * start for _, _, start, stop, sync in own[1:])
    # b's values go after a's n_a narrow slots, i.e. into fp32 slots [n_a/2, (n_a+n_b)/2) < n_a
    assert last == (b.data_ptr(), a.data_ptr() + 2 * n_a, 0, n_b, False) and n_b <= n_a


def test_bf16_cast_keeps_every_nan():
    """fp32 → bf16 through our cast kernels keeps NaN a NaN whatever its payload (the GPU
    writes the canonical NaN; the interpreter's pre-rounding of the bits once carried
    0x7FFFFFFF into -0.0 and 0x7F800001 into inf), and rounds the rest to nearest even."""
    from logitless.triton_kernels import narrow_cast
    bits = torch.tensor([0x7FFFFFFF, 0x7F800001, -0x7FFF, 0x7FC00000, -0x00400000],
                        dtype=torch.int32)
    nans = bits.view(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    finite = torch.cat([torch.randn(1000, generator=gen) * 10.0 ** torch.arange(-20, 20, 0.04),
                        torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])])
    src = torch.cat([nans, finite]).to(DEV)
    assert torch.isnan(src[:5]).all()
    interpret = not CUDA
    out = narrow_cast.scale_cast(src, None, torch.bfloat16, interpret)
    assert torch.isnan(out[:5]).all(), out[:5]
    assert torch.equal(out[5:].cpu(), finite.bfloat16())  # torch rounds to nearest even


# ----------------------------------------------------------------------------- skip_ignored
def _spy_live(monkeypatch):
    """The live counts our logits GEMM is launched with (None: every row)."""
    return _spy_own_gemm(monkeypatch, lambda args, live: None if live is None else
                         int(live.item()))


@pytest.mark.parametrize("dtype,ignored,dx_gemm,split", [
    (torch.bfloat16, "some", False, False), (torch.float16, "chunk", False, False),
    (torch.bfloat16, "all", False, False), (torch.float16, "none", False, False),
    (torch.bfloat16, "some", True, False), (torch.float16, "chunk", True, False),
    (torch.bfloat16, "chunk", False, True)])
def test_skip_ignored_equals_every_row_computed(monkeypatch, dtype, ignored, dx_gemm, split):
    """skip_ignored=True (each chunk's live tokens first, our GEMM and the row kernel leave
    the rest out) gives the loss and gradients of skip_ignored=False: some tokens ignored, a
    whole chunk of them, all, none; every option; a non-contiguous x (a transposed view) and a
    ragged last chunk. The GEMM is launched with each chunk's live count; the loss-only
    forward ("none", no grad) takes it too, in the tokens' order. ``dx_gemm``: dX of the live
    rows by our GEMM (``dx_gemm="triton"``), zeros past them. ``split``: rows split over
    programs (two launches interpreted: the blank rows in the second)."""
    # three chunks, the last ragged; V over several of the interpreter's 32-column tiles
    n, h, v, chunk = 40, 32, 131, 16
    g = torch.Generator().manual_seed(SEED + 41)
    x = torch.randn(h, n, generator=g).to(DEV, dtype).t()  # non-contiguous
    w = (torch.randn(v, h, generator=g) * h ** -0.5).to(DEV, dtype)
    b = torch.randn(v, generator=g).to(DEV, dtype)
    cw = torch.rand(v, generator=g).to(DEV) + 0.5
    y = torch.randint(0, v, (n,), generator=g)
    mask = {"some": torch.rand(n, generator=g) < 0.3, "all": torch.ones(n, dtype=torch.bool),
            "none": torch.zeros(n, dtype=torch.bool),
            "chunk": (torch.arange(n) >= chunk) & (torch.arange(n) < 2 * chunk)}[ignored]
    y[mask] = -100
    y = y.to(DEV)
    # split: the launches' plan, not the options (tanh is the interpreter's slowest op)
    kw = dict(backend="triton", linear_bias=b, weight=cw, z_loss=1e-3, label_smoothing=0.1,
              chunk_size=chunk, **(dict(segment_size=64, block_v=64) if split else
                                   dict(softcap=6.0)))

    def run(skip, reduction="mean"):
        own_dx = dict(dx_gemm="triton") if (skip and dx_gemm) else {}
        xx, ww, bb = (t.detach().requires_grad_() for t in (x, w, b))
        loss = lt.linear_cross_entropy(xx, ww, y, **{**kw, "linear_bias": bb, **own_dx},
                                       reduction=reduction, skip_ignored=skip)
        loss.backward()
        return loss.detach(), xx.grad, ww.grad, bb.grad

    ref = run(False)
    calls = _spy_live(monkeypatch)
    import logitless.triton_kernels.dx_gemm as dx_mod
    dx_calls = []
    real_dx = dx_mod.dx_live
    monkeypatch.setattr(dx_mod, "dx_live", lambda *a: dx_calls.append(a[3]) or real_dx(*a))
    got = run(True)
    live = [int((~mask[s:s + chunk]).sum()) for s in range(0, n, chunk)]
    assert calls == live, (calls, live)
    assert len(dx_calls) == (len(live) if dx_gemm else 0)
    assert torch.isfinite(got[0]) and all(torch.isfinite(t).all() for t in got[1:])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for a, r in zip(got[1:], ref[1:]):
        if ignored == "all":
            assert not a.any()  # ignored tokens: zero gradients, not junk
            continue
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 1e-3, rel  # summation order only: dz is computed alike
    assert not got[1][mask.to(DEV)].any()  # an ignored token's dX row: exactly 0
    if ignored == "chunk" and not split:  # no dX wanted (x frozen): x into a buffer of ours
        ww = w.detach().requires_grad_()
        lt.linear_cross_entropy(x, ww, y, **kw, skip_ignored=True).backward()
        rel = ((ww.grad.float() - ref[2].float()).norm() / ref[2].float().norm()).item()
        assert rel < 1e-3, rel
    if ignored == "some" and not dx_gemm:
        sums = run(True, "sum"), run(False, "sum")
        torch.testing.assert_close(sums[0][0], sums[1][0], rtol=1e-5, atol=1e-6)
        calls.clear()
        with torch.no_grad():
            none = [lt.linear_cross_entropy(x, w, y, **kw, reduction="none", skip_ignored=s)
                    for s in (True, False)]
        assert calls == live  # the loss-only forward skipped them too
        torch.testing.assert_close(none[0], none[1], rtol=1e-5, atol=1e-6)
        assert not none[0][mask.to(DEV)].any()


def test_live_first_orders_each_chunk_live_first():
    from logitless.triton_kernels.live_rows import live_first
    y = torch.tensor([5, -100, 3, -100, -100, 7, 1, -100, 2], device=DEV)
    perm, live = live_first(y, -100, 4)
    assert perm.tolist() == [0, 2, 1, 3, 5, 6, 4, 7, 8]
    assert live.tolist() == [2, 2, 1] and live.dtype == torch.int32


def test_skip_ignored_errors():
    x, w, y = _data(8, 16, 32, dtype=torch.bfloat16)
    x.requires_grad_()
    cases = [
        (dict(skip_ignored="yes"), "skip_ignored must be"),
        (dict(skip_ignored=True, return_lse=True), "return_lse"),
        (dict(skip_ignored=True, low_memory=True), "low-memory"),
        (dict(skip_ignored=True, logits_gemm="cublas"), "cuBLAS"),
        (dict(skip_ignored=True, reduction="none"), "per-token"),
        (dict(dx_gemm="ours"), "dx_gemm must be"),
        (dict(dx_gemm="triton", skip_ignored=False), "needs skip_ignored"),
        (dict(dx_gemm="triton", return_lse=True), "dx_gemm='triton' .* cannot run"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            lt.linear_cross_entropy(x, w, y, backend="triton", **kw)
    with pytest.raises(ValueError, match="bfloat16/float16"):
        lt.linear_cross_entropy(x.float(), w.float(), y, backend="triton", skip_ignored=True)
    with pytest.raises(ValueError, match="16-byte aligned rows"):  # H = 12: 24-byte rows
        a, b, c = _data(8, 12, 32, dtype=torch.bfloat16)
        lt.linear_cross_entropy(a, b, c, backend="triton", skip_ignored=True)
