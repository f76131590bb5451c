"""Go/no-go probe (GPU): can a Triton GEMM of our own match cuBLAS at the chunk shapes of the
linear-CE / JSD ops? Owning the GEMMs is what fusing the softmax work into their epilogues and
prologues needs (DESIGN.md). Times a persistent TMA (tensor-descriptor) Triton GEMM in several
configurations against torch.mm for the three GEMMs of one token chunk at the Llama shape, and
the cost of a softmax-statistics epilogue. Writes JSON lines to --out. Not a user benchmark."""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from logitless._torch_common import accumulate_mm_  # noqa: E402
from logitless.triton_kernels.logits_gemm import grouped_tile  # noqa: E402


@triton.jit
def _gemm(a_desc, b_desc, c_desc, stat_m, stat_s, M, N, K,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
          NUM_SMS: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, EPI: tl.constexpr,
          FLATTEN: tl.constexpr, WS: tl.constexpr):
    # A is [M, K] (or [K, M] when A_KM), B is [N, K] (or [K, N] when B_KN); C = A·B.
    # EPI 0: store C in c_desc's dtype; 1: C += A·B (fp32 read-modify-write); 2: store C and
    # per-(row, column-tile) max and Σexp of the fp32 tile (the softmax statistics).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(pid, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            ok = ki * BK
            if A_KM:
                a = a_desc.load([ok, om]).T
            else:
                a = a_desc.load([om, ok])
            if B_KN:
                b = b_desc.load([ok, on])
            else:
                b = b_desc.load([on, ok]).T
            acc = tl.dot(a, b, acc)
        if EPI == 1:
            acc += c_desc.load([om, on])
            c_desc.store([om, on], acc)
        elif EPI == 2:
            cols = on + tl.arange(0, BN)
            z = tl.where((cols < N)[None, :], acc, float("-inf"))
            m = tl.max(z, 1)
            s = tl.sum(tl.exp(z - m[:, None]), 1)
            rows = (om + tl.arange(0, BM)).to(tl.int64)
            idx = rows * num_pid_n + pid_n
            tl.store(stat_m + idx, m, mask=rows < M)
            tl.store(stat_s + idx, s, mask=rows < M)
            c_desc.store([om, on], acc.to(c_desc.dtype))
        else:
            c_desc.store([om, on], acc.to(c_desc.dtype))


def gemm(a, b, c, *, a_km, b_kn, epi=0, bm=128, bn=256, bk=64, group_m=8, stages=3,
         warps=8, flatten=False, ws=False, stats=None):
    M, K = (a.shape[1], a.shape[0]) if a_km else a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    a_desc = TensorDescriptor.from_tensor(a, [bk, bm] if a_km else [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bk, bn] if b_kn else [bn, bk])
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    sm_, ss_ = stats if stats is not None else (c, c)
    _gemm[(min(sms, tiles),)](a_desc, b_desc, c_desc, sm_, ss_, M, N, K, BM=bm, BN=bn, BK=bk,
                              GROUP_M=group_m, NUM_SMS=min(sms, tiles), A_KM=a_km, B_KN=b_kn,
                              EPI=epi, FLATTEN=flatten, WS=ws, num_stages=stages,
                              num_warps=warps)
    return c


def bench(fn, reps=10, warmup=3):
    return common.time_fn(fn, device="cuda", reps=reps, warmup=warmup).median_ms


CONFIGS = [
    dict(bm=128, bn=256, bk=64, stages=3, warps=8),
    dict(bm=128, bn=256, bk=64, stages=3, warps=8, flatten=True),
    dict(bm=128, bn=256, bk=64, stages=3, warps=8, group_m=16, flatten=True),
    dict(bm=128, bn=128, bk=64, stages=4, warps=8),
    dict(bm=128, bn=128, bk=64, stages=4, warps=8, flatten=True),
    dict(bm=128, bn=128, bk=64, stages=4, warps=4, flatten=True),
    dict(bm=128, bn=256, bk=64, stages=2, warps=8, flatten=True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gemm_probe.jsonl")
    ap.add_argument("--shapes", default="4096,4096,128256;2048,2304,256000;512,4096,128256")
    args = ap.parse_args()
    out = open(args.out, "a")
    for shape in args.shapes.split(";"):
        probe(shape, out)


def probe(shape, out):
    c_tok, h, v = map(int, shape.split(","))
    dev = "cuda"
    x = torch.randn(c_tok, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
    z = torch.empty(c_tok, v, device=dev, dtype=torch.bfloat16)
    dx = torch.empty(c_tok, h, device=dev, dtype=torch.bfloat16)
    acc = torch.zeros(v, h, device=dev, dtype=torch.float32)
    nt = triton.cdiv(v, 128)  # room for the narrowest column tile
    st = (torch.empty(c_tok * nt, device=dev), torch.empty(c_tok * nt, device=dev))

    def rec(**kw):
        kw["shape"] = shape
        print(json.dumps(kw), flush=True)
        out.write(json.dumps(kw) + "\n")
        out.flush()

    flops = 2 * c_tok * h * v
    ref = {"logits": bench(lambda: torch.mm(x, w.t(), out=z)),
           "dx": bench(lambda: torch.mm(z, w, out=dx)),
           "dw_acc": bench(lambda: accumulate_mm_(acc, z.t(), x))}
    rec(kind="cublas", tflops={k: round(flops / t / 1e9) for k, t in ref.items()}, **ref)
    zr = torch.mm(x, w.t())
    dxr = torch.mm(zr, w)
    for cfg in CONFIGS:
        res = dict(cfg)
        for name, fn in {
            "logits": lambda: gemm(x, w, z, a_km=False, b_kn=False, **cfg),
            "logits_stats": lambda: gemm(x, w, z, a_km=False, b_kn=False, epi=2,
                                         stats=st, **cfg),
            "dx": lambda: gemm(zr, w, dx, a_km=False, b_kn=True, **cfg),
            "dw_acc": lambda: gemm(z, x, acc, a_km=True, b_kn=True, epi=1, **cfg),
        }.items():
            try:
                fn()
                torch.cuda.synchronize()
                if name == "logits":
                    res["logits_err"] = float((z.float() - zr.float()).abs().max())
                if name == "dx":
                    res["dx_err"] = float((dx.float() - dxr.float()).abs().max()
                                          / dxr.float().abs().max())
                res[name] = bench(fn)
            except Exception as e:  # a config the compiler rejects is a result too
                res[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
                if "illegal" in str(e):
                    rec(kind="abort", **res)
                    raise
        rec(kind="triton", **res)
    del x, w, z, dx, acc, st, zr, dxr
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
