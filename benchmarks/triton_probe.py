"""Tuning probe for the Triton linear-CE backend (GPU): the three-GEMM floor, the backend's
fast and low-memory modes, and variants of the row kernel's launch, at TARGETS.md shapes.
Writes JSON lines to --out. Not a user benchmark (see linear_cross_entropy.py for that)."""
import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import logitless.torch as lt  # noqa: E402
import logitless.triton_kernels.linear_cross_entropy as tlce  # noqa: E402
from benchmarks import common  # noqa: E402


def bench(fn, reps=10, warmup=3):
    """Median ms of ``fn`` on the GPU (benchmarks.common.time_fn: CUDA events per call)."""
    return common.time_fn(fn, device="cuda", reps=reps, warmup=warmup).median_ms


def inputs(n, h, v, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=dtype, generator=g) * (2.0 / h ** 0.5)).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return x, w, y


def floor_ms(n, h, v):
    a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    gl = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)

    def f():
        torch.mm(a, w.t(), out=out)
        torch.mm(gl, w)
        torch.mm(gl.t(), a)
    t = bench(f)
    del a, w, gl, out
    torch.cuda.empty_cache()
    return t


def run_case(x, w, y, **kw):
    def f():
        x.grad = None
        w.grad = None
        loss = lt.linear_cross_entropy(x, w, y, backend="triton", **kw)
        loss.backward()
    t = bench(f)
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - x.grad.numel() * 2 - w.grad.numel() * 2
    return t, extra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384,4096,128256;8192,2304,256000")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--out", default="/dev/stdout")
    args = ap.parse_args()
    rows = []
    for shp in args.shapes.split(";"):
        n, h, v = map(int, shp.split(","))
        fl = floor_ms(n, h, v)
        flops = 6 * n * h * v
        print(f"shape {n},{h},{v}: floor {fl:.2f} ms ({flops / fl / 1e9:.0f} TFLOP/s)", flush=True)
        x, w, y = inputs(n, h, v)
        for variant in args.variants.split(";"):
            kw = {} if variant == "default" else json.loads(variant)
            pps = kw.pop("pps", None)
            if "grad_accum_dtype" in kw:
                kw["grad_accum_dtype"] = getattr(torch, kw["grad_accum_dtype"])
            if pps:
                tlce.PROGRAMS_PER_SM = pps; tlce.LONG_ROW = 1 << 30
            try:
                t, extra = run_case(x, w, y, **kw)
                r = dict(shape=[n, h, v], variant=variant, ms=t, ratio=t / fl, floor_ms=fl,
                         extra_gib=extra / 2**30)
            except Exception as e:  # record and go on
                r = dict(shape=[n, h, v], variant=variant, error=repr(e)[-400:])
            tlce.PROGRAMS_PER_SM = 4; tlce.LONG_ROW = 16384
            rows.append(r)
            print(json.dumps(r), flush=True)
        del x, w, y
        torch.cuda.empty_cache()
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")




def stages(n, h, v, chunk):
    """Time each stage of one token chunk in isolation (ms), to see where the time goes."""
    from logitless.triton_kernels.linear_cross_entropy import Config, _rows, _ones
    x = torch.randn(chunk, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * (2.0 / h ** 0.5)
    y = torch.randint(0, v, (chunk,), device="cuda")
    buf = torch.empty(chunk, v, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, w.t(), out=buf)
    keep = buf.clone()
    lse = torch.empty(chunk, device="cuda")
    loss = torch.empty(chunk, device="cuda")
    acc = torch.zeros(v, h, device="cuda")
    dwb = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(chunk, h, device="cuda", dtype=torch.bfloat16)
    cfg = Config(chunk, chunk, 0, 8)
    opts_t = (-100, 0.0, 0.0, None)
    ones = _ones(x)
    gb = chunk * v * 2 / 1e9
    out = {}
    if n:  # n = 0: kernel-only sweep
        out["logits_gemm"] = bench(lambda: torch.mm(x, w.t(), out=buf))
        out["dx_gemm"] = bench(lambda: torch.mm(buf, w, out=dx))
        out["dw_gemm_bf16"] = bench(lambda: torch.mm(buf.t(), x, out=dwb))
        out["dw_mm_f32"] = bench(lambda: torch.mm(buf.t(), x, out_dtype=torch.float32, out=acc))
        out["dw_addmm_f32"] = bench(lambda: torch.addmm(acc, buf.t(), x, out_dtype=torch.float32, out=acc))
        out["acc_to_bf16"] = bench(lambda: dwb.copy_(acc))
    out["copy_chunk"] = bench(lambda: buf.copy_(keep))
    configs = [(16384, 32, p) for p in (0.5, 0.75, 1, 1.5, 2)] + [(8192, 32, 1), (32768, 32, 1), (8192, 16, 1.5)]
    for bv, nw, pps in configs:
        tlce.PROGRAMS_PER_SM = pps; tlce.LONG_ROW = 1 << 30
        c2 = Config(chunk, chunk, bv, nw)

        def k(write, compute=True):
            buf.copy_(keep)
            _rows(buf, chunk, v, 0, y, None, None, lse, loss, ones, None, opts_t, v, c2,
                  compute_lse=compute, write_grad=write)
        base = out["copy_chunk"]
        out[f"rows_lse_only_{bv}_{nw}_{pps}"] = bench(lambda: k(False)) - base
        out[f"rows_lse_grad_{bv}_{nw}_{pps}"] = bench(lambda: k(True)) - base
        out[f"rows_grad_only_{bv}_{nw}_{pps}"] = bench(lambda: k(True, False)) - base
    tlce.PROGRAMS_PER_SM = 4; tlce.LONG_ROW = 16384
    out["chunk_gb"] = gb
    return out


def gemm_shapes(h, v, ms=(256, 512, 1024, 2048, 4096)):
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    r = {}
    for m in ms:
        a = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(m, v, device="cuda", dtype=torch.bfloat16)
        fl = 2 * m * h * v
        r[f"logits_M{m}_tflops"] = fl / bench(lambda: torch.mm(a, w.t())) / 1e9
        r[f"dx_M{m}_tflops"] = fl / bench(lambda: torch.mm(g, w)) / 1e9
    return r


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["profile"]:
        for shp in sys.argv[2].split(";"):
            n, h, v = map(int, shp.split(","))
            x, w, y = inputs(n, h, v)
            kw = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
            def one():
                x.grad = w.grad = None
                lt.linear_cross_entropy(x, w, y, backend="triton", **kw).backward()
            one()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                one()
                torch.cuda.synchronize()
            print(f"== profile {n},{h},{v} {kw}")
            print(prof.key_averages(group_by_input_shape=True).table(
                sort_by="cuda_time_total", row_limit=30, max_name_column_width=50,
                max_shapes_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
            # pure GPU time: the same step replayed from a CUDA graph (also proves capturability)
            def no_grads():
                x.grad = w.grad = None
            g = common.capture_cuda_graph(
                lambda: lt.linear_cross_entropy(x, w, y, backend="triton", **kw).backward(),
                no_grads)
            print(f"cuda-graph replay: {bench(g.replay):.2f} ms; eager: {bench(one):.2f} ms")
            del x, w, y
            torch.cuda.empty_cache()
    elif sys.argv[1:2] == ["stages"]:
        for shp in sys.argv[2].split(";"):
            n, h, v, c = map(int, shp.split(","))
            print(json.dumps(dict(shape=[n, h, v, c], **stages(n, h, v, c))), flush=True)
            if n:
                print(json.dumps(dict(shape=[h, v], **gemm_shapes(h, v))), flush=True)
    else:
        main()
