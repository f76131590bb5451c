"""GPU probe: per-chunk stage times of the fast linear-CE forward with the logits from cuBLAS
plus the two-pass row kernel, against the statistics-epilogue Triton GEMM (several tile
settings) plus the one-pass row kernel (``logits_gemm``); ``--grad-shapes``: the dz-epilogue
GEMM; ``--plain-shapes``: the plain GEMM of ``skip_ignored`` with a live count;
``--dx-shapes``: the dX GEMM of the live rows (``dx_gemm``) against cuBLAS; ``--f32-shapes``:
the plain GEMM with an fp32 output (what a JSD ``skip_ignored`` would need: its logits are
fp32) against cuBLAS's fp32-output GEMM. JSON lines to --out; not a user benchmark (DESIGN.md
records what it found)."""
import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from logitless._torch_common import rows_buffer  # noqa: E402
from logitless.triton_kernels import linear_cross_entropy as tl_lce  # noqa: E402
from logitless.triton_kernels import logits_gemm as sg  # noqa: E402

TILES = [
    dict(bm=128, bn=256, bk=64, group_m=8, stages=3, warps=8, ws=True),
    dict(bm=128, bn=128, bk=64, group_m=8, stages=4, warps=4, ws=True),
    dict(bm=128, bn=256, bk=64, group_m=8, stages=4, warps=8, ws=True),
    dict(bm=128, bn=256, bk=64, group_m=16, stages=3, warps=8),
    dict(bm=128, bn=256, bk=64, group_m=8, stages=3, warps=8),
]


def ms(fn, reps):
    return common.time_fn(fn, device="cuda", reps=reps, warmup=2).median_ms


def probe(c_tok, h, v, reps, out):
    dev = "cuda"
    x = torch.randn(c_tok, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
    y = torch.randint(0, v, (c_tok,), device=dev)
    buf = rows_buffer(c_tok, v, torch.bfloat16, dev)  # TMA: 16-byte aligned rows
    f32 = dict(device=dev, dtype=torch.float32)
    lse, loss, g = torch.empty(c_tok, **f32), torch.empty(c_tok, **f32), torch.ones(1, **f32)
    cfg = tl_lce.Config(c_tok, v, 0, 0)
    opts = (-100, 0.0, 0.0, None)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def rows(stats):
        tl_lce._rows(buf, None, c_tok, v, 0, y, None, None, lse, loss, g, None, opts, v, cfg,
                     compute_lse=True, write_grad=True, stats=stats)

    rec = dict(shape=f"{c_tok}x{h}x{v}")
    rec["cublas_logits"] = ms(lambda: torch.mm(x, w.t(), out=buf), reps)
    torch.mm(x, w.t(), out=buf)
    rec["rows_two_pass"] = ms(lambda: (torch.mm(x, w.t(), out=buf), rows(None)), reps) \
        - rec["cublas_logits"]
    emit(rec, out)

    def measure(r):
        n_tiles = sg.stat_tiles(v, False)
        st = (torch.empty(c_tok, n_tiles, **f32), torch.empty(c_tok, n_tiles, **f32))
        gemm = lambda: sg.logits_with_stats(x, w, None, buf, st[0], st[1], None, False, sms)
        r["own_logits_stats"] = ms(gemm, reps)
        r["rows_one_pass"] = ms(lambda: (gemm(), rows(st)), reps) - r["own_logits_stats"]
        r["total_vs_cublas"] = (r["own_logits_stats"] + r["rows_one_pass"]
                                - rec["cublas_logits"] - rec["rows_two_pass"])
    each_tiling(TILES, dict(shape=rec["shape"]), measure, out)


def emit(rec, out):
    print(json.dumps(rec), flush=True)
    out.write(json.dumps(rec) + "\n")


def each_tiling(tilings, base, measure, out):
    """``measure(record)`` under each of ``tilings`` (set as logits_gemm.GPU_TILES, restored
    after); a configuration the compiler rejects is a result too."""
    saved = dict(sg.GPU_TILES)
    try:
        for t in tilings:
            sg.GPU_TILES.clear()
            sg.GPU_TILES.update(t)
            r = dict(base, **t)
            try:
                measure(r)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            emit(r, out)
    finally:
        sg.GPU_TILES.clear()
        sg.GPU_TILES.update(saved)


GRAD_TILES = [
    dict(bm=128, bn=256, bk=64, group_m=16, stages=3, warps=8),
    dict(bm=128, bn=256, bk=64, group_m=8, stages=4, warps=8),
    dict(bm=128, bn=128, bk=64, group_m=8, stages=4, warps=4),
    dict(bm=128, bn=128, bk=64, group_m=8, stages=4, warps=8),
    dict(bm=256, bn=128, bk=64, group_m=8, stages=3, warps=8),
    dict(bm=128, bn=256, bk=64, group_m=8, stages=3, warps=8, ws=True),
]


def probe_grad(m, h, v, reps, out):
    """A recomputing sweep's block (rows x classes, lse known): cuBLAS logits + the row
    kernel's gradient pass against the dz-epilogue GEMM (``logits_gemm.logit_grads``)."""
    dev = "cuda"
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
    y = torch.randint(0, v, (m,), device=dev)
    buf = rows_buffer(m, v, torch.bfloat16, dev)
    f32 = dict(device=dev, dtype=torch.float32)
    lse, g = torch.randn(m, **f32) + 12.0, torch.ones(1, **f32)
    cfg = tl_lce.Config(m, v, 0, 0)
    opts = (-100, 0.0, 0.0, None)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rec = dict(mode="grad", shape=f"{m}x{h}x{v}")
    rec["cublas_logits"] = ms(lambda: torch.mm(x, w.t(), out=buf), reps)
    rec["rows_grad_pass"] = ms(lambda: tl_lce._rows(
        buf, None, m, v, 0, y, None, None, lse, None, g, None, opts, v, cfg, compute_lse=False,
        write_grad=True), reps)
    emit(rec, out)

    def measure(r):
        r["own_grad_gemm"] = ms(lambda: sg.logit_grads(
            x, w, 0, buf, None, y, None, None, lse, g, None, opts, False, sms), reps)
        r["vs_cublas_plus_pass"] = (r["own_grad_gemm"] - rec["cublas_logits"]
                                    - rec["rows_grad_pass"])
    each_tiling(GRAD_TILES, dict(mode="grad", shape=rec["shape"]), measure, out)


PLAIN_TILES = [
    dict(bm=128, bn=256, bk=64, group_m=16, stages=3, warps=8),
    dict(bm=128, bn=256, bk=64, group_m=8, stages=4, warps=8),
    dict(bm=128, bn=256, bk=64, group_m=16, stages=3, warps=8, ws=True),
]


def probe_plain(c_tok, h, v, reps, out, fp32_out=False):
    """The plain-store GEMM that ``skip_ignored`` runs (no statistics), against cuBLAS, with
    every row live and with 90% / 50% of them (the rest skipped by the live count).
    ``fp32_out``: fp32 logits (what a JSD ``skip_ignored`` would need) against cuBLAS's
    bf16 x bf16 -> fp32 GEMM, under ``F32_TILES`` (records of mode "f32")."""
    dev = "cuda"
    x = torch.randn(c_tok, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
    buf = rows_buffer(c_tok, v, torch.float32 if fp32_out else torch.bfloat16, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    mode, ref = ("f32", "cublas_f32") if fp32_out else ("plain", "cublas_logits")
    cublas = dict(out_dtype=torch.float32) if fp32_out else {}
    rec = dict(mode=mode, shape=f"{c_tok}x{h}x{v}")
    rec[ref] = ms(lambda: torch.mm(x, w.t(), out=buf, **cublas), reps)
    emit(rec, out)
    want = torch.mm(x, w.t(), **cublas)

    def measure(r):
        for frac in (1.0, 0.9, 0.5):
            live = torch.tensor([int(c_tok * frac)], dtype=torch.int32, device=dev)
            t = ms(lambda: sg.logits_with_stats(x, w, None, buf, None, None, None, False, sms,
                                                live=live), reps)
            r[f"own_{mode}_live{frac}"] = t
            r[f"ratio_live{frac}"] = t / rec[ref]
        sg.logits_with_stats(x, w, None, buf, None, None, None, False, sms)
        diff = (buf.float() - want.float()).abs().max()
        if fp32_out:
            r["max_rel_diff_vs_cublas"] = (diff / want.abs().max()).item()
        else:
            r["max_abs_diff_vs_cublas"] = diff.item()
    each_tiling(F32_TILES if fp32_out else PLAIN_TILES, dict(mode=mode, shape=rec["shape"]),
                measure, out)


# fp32 epilogue tiles: a 128 x 256 fp32 tile is 128 KiB of shared memory for the TMA store,
# so the deep pipelines of the 16-bit store no longer fit beside it
F32_TILES = [
    dict(bm=128, bn=256, bk=64, group_m=16, stages=2, warps=8),
    dict(bm=128, bn=128, bk=64, group_m=16, stages=4, warps=4),
    dict(bm=128, bn=128, bk=64, group_m=16, stages=4, warps=8),
    dict(bm=128, bn=128, bk=64, group_m=8, stages=5, warps=8),
    dict(bm=64, bn=256, bk=64, group_m=16, stages=4, warps=4),
]


DX_TILES = [
    dict(bm=128, bn=256, bk=64, group_m=8, stages=3, warps=8),
    dict(bm=128, bn=256, bk=64, group_m=16, stages=3, warps=8),
    dict(bm=128, bn=128, bk=64, group_m=8, stages=4, warps=4),
    dict(bm=256, bn=128, bk=64, group_m=8, stages=3, warps=8),
    dict(bm=128, bn=256, bk=64, group_m=8, stages=3, warps=8, ws=True),
]


def probe_dx(c_tok, h, v, reps, out):
    """``dx_gemm.dx_live`` (dX of the live rows, zeros past them) against cuBLAS's full
    ``dz @ W``, with 100 / 90 / 50% of the rows live."""
    from logitless.triton_kernels import dx_gemm
    dev = "cuda"
    dz = rows_buffer(c_tok, v, torch.bfloat16, dev)
    dz.copy_(torch.randn(c_tok, v, device=dev, dtype=torch.bfloat16) * 1e-3)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h ** -0.5
    dx = torch.empty(c_tok, h, device=dev, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rec = dict(mode="dx", shape=f"{c_tok}x{h}x{v}")
    rec["cublas_dx"] = ms(lambda: torch.mm(dz, w, out=dx), reps)
    emit(rec, out)
    want = torch.mm(dz, w)

    def measure(r):
        saved = dict(dx_gemm.GPU_TILES)
        dx_gemm.GPU_TILES.clear()
        dx_gemm.GPU_TILES.update(sg.GPU_TILES)  # each_tiling set logits_gemm's
        try:
            for frac in (1.0, 0.9, 0.5):
                live = torch.tensor([int(c_tok * frac)], dtype=torch.int32, device=dev)
                t = ms(lambda: dx_gemm.dx_live(dz, w, dx, live, False, sms), reps)
                r[f"own_dx_live{frac}"] = t
                r[f"ratio_live{frac}"] = t / rec["cublas_dx"]
            dx_gemm.dx_live(dz, w, dx, None, False, sms)
            r["max_rel_diff_vs_cublas"] = ((dx.float() - want.float()).abs().max()
                                           / want.float().abs().max()).item()
        finally:
            dx_gemm.GPU_TILES.clear()
            dx_gemm.GPU_TILES.update(saved)
    each_tiling(DX_TILES, dict(mode="dx", shape=rec["shape"]), measure, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/logits_gemm_probe.jsonl")
    ap.add_argument("--shapes", default="3584,4096,128256;1792,2304,256000")
    ap.add_argument("--grad-shapes", default="",
                    help="rows,H,classes;... blocks for the dz-epilogue GEMM (e.g. "
                         "16384,4096,8192 for low-memory's vocabulary sweep at Llama)")
    ap.add_argument("--plain-shapes", default="",
                    help="tokens,H,V;... chunks for the plain GEMM of skip_ignored (e.g. "
                         "3277,4096,128256;4096,2304,256000)")
    ap.add_argument("--dx-shapes", default="",
                    help="tokens,H,V;... chunks for dx_gemm (e.g. 3277,4096,128256)")
    ap.add_argument("--f32-shapes", default="",
                    help="tokens,H,V;... sub-chunks for the fp32-output plain GEMM (e.g. "
                         "384,4096,128256, the JSD's at Llama)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    with open(a.out, "a") as out:
        for s in filter(None, a.shapes.split(";")):
            probe(*map(int, s.split(",")), a.reps, out)
        for s in filter(None, a.grad_shapes.split(";")):
            probe_grad(*map(int, s.split(",")), a.reps, out)
        for s in filter(None, a.plain_shapes.split(";")):
            probe_plain(*map(int, s.split(",")), a.reps, out)
        for s in filter(None, a.dx_shapes.split(";")):
            probe_dx(*map(int, s.split(",")), a.reps, out)
        for s in filter(None, a.f32_shapes.split(";")):
            probe_plain(*map(int, s.split(",")), a.reps, out, fp32_out=True)


if __name__ == "__main__":
    main()
