"""Vocab-parallel linear cross-entropy and FSDP2 on several GPUs: checks and a scaling table.

    torchrun --standalone --nproc_per_node=2 benchmarks/vocab_parallel.py --out benchmarks/results
    torchrun --standalone --nproc_per_node=1 benchmarks/vocab_parallel.py --out benchmarks/results
    # CPU smoke run of every code path (gloo, tiny shapes):
    .venv/bin/torchrun --standalone --nproc_per_node=2 benchmarks/vocab_parallel.py --device cpu --small

One run with ``nproc_per_node = P`` (NCCL on CUDA, gloo on CPU):

(a) equality: for every option (bias, class weights, label smoothing, z-loss, softcap, each
    reduction, return_lse with an lse gradient, all-ignored batches, a rank owning none of the
    targets) at small shapes, fp32 and bf16, the vocab-parallel loss/lse/dX/dW-slice/db-slice
    against the float64 spec (on the host) with tolerance max(2 x the error of the
    single-device fused loss on the same inputs, floor); prints PASS/FAIL lines.
(b) FSDP2 (``fully_shard``) of a small model with ``TiledMLP`` and the fused loss (default
    backend: Triton on CUDA) on different data per rank, with the global-token mean recipe:
    gradients against the same model in one process on the concatenated batch.
(c) timing: fwd+bwd of the vocab-parallel loss at N=16384, H=4096, V=128256 bf16 (TP=P, each
    rank holding V/P rows), and at TP=1 also the single-GPU fused loss (Triton) for reference;
    median time and peak memory per GPU above the inputs.

Writes ``<out>/<gpu>-vocab-parallel-tp<P>.json`` (``cpu-...`` on CPU) and, when the file of
the other TP size is there, prints the scaling table. Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
import logitless.torch as lt  # noqa: E402
from logitless.specs import linear_cross_entropy as spec  # noqa: E402

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3}
EVERYTHING = dict(bias=True, class_weight=True, label_smoothing=0.2, z_loss=1e-2, softcap=5.0,
                  lse_grad=True)


def log0(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# ----------------------------------------------------------------------------- (a) equality
def _cases():
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for red in ("mean", "sum", "none"):
            out.append(dict(dtype=dtype, reduction=red))
            out.append(dict(dtype=dtype, reduction=red, **EVERYTHING))
    for opt in (dict(bias=True), dict(class_weight=True), dict(label_smoothing=0.1),
                dict(z_loss=1e-3), dict(softcap=4.0), dict(lse_grad=True)):
        out.append(dict(dtype=torch.float32, reduction="mean", **opt))
    out.append(dict(dtype=torch.bfloat16, reduction="mean", ignore="all", **EVERYTHING))
    out.append(dict(dtype=torch.float32, reduction="sum", ignore="no-target-shard", **EVERYTHING))
    out.append(dict(dtype=torch.bfloat16, reduction="none", chunk_size=48, n=300, **EVERYTHING))
    return out


def _inputs(c, world, seed):
    g = torch.Generator().manual_seed(seed)
    n, h, v = c.get("n", 77), 64, 96 * world + 0  # V divisible by the world: the equal split
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * (3.0 / h ** 0.5)
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    if c.get("ignore") == "all":
        y[:] = -100
    if c.get("ignore") == "no-target-shard":  # the last rank's slice: no targets
        y[y >= v - v // world] = 0
    b = torch.randn(v, generator=g) * 0.5 if c.get("bias") else None
    cw = torch.rand(v, generator=g) * 1.75 + 0.25 if c.get("class_weight") else None
    red = c["reduction"]
    go = torch.rand(n if red == "none" else (), generator=g) + 0.5
    gl = torch.randn(n, generator=g) if c.get("lse_grad") else None
    rd = lambda t: None if t is None else t.to(c["dtype"])  # round once: all paths see it
    return rd(x), rd(w), rd(b), y, cw, go, gl


def _run(c, x, w, b, y, cw, go, gl, dev, **kw):
    leaf = lambda t: t.detach().to(dev, copy=True).requires_grad_()  # fresh leaves per run
    x, w = leaf(x), leaf(w)
    b = None if b is None else leaf(b)
    cw = None if cw is None else cw.to(dev)
    loss, lse = lt.linear_cross_entropy(
        x, w, y.to(dev), linear_bias=b, weight=cw, reduction=c["reduction"],
        label_smoothing=c.get("label_smoothing", 0.0), z_loss=c.get("z_loss", 0.0),
        softcap=c.get("softcap"), return_lse=True, **kw)
    outs, grads = [loss], [go.to(dev)]
    if gl is not None:
        outs.append(lse)
        grads.append(gl.to(dev))
    torch.autograd.backward(outs, grads)
    r = dict(loss=loss, dx=x.grad, dw=w.grad)
    if gl is not None:
        r["lse"] = lse
    if b is not None:
        r["db"] = b.grad
    return {k: v.detach().double().cpu().numpy() for k, v in r.items()}


def _rel(a, r):
    return float(np.linalg.norm((a - r).ravel()) / max(np.linalg.norm(r.ravel()), 1e-300))


def check_equality(dev, group, chunk_kw):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    fails = 0
    for i, c in enumerate(_cases()):
        x, w, b, y, cw, go, gl = _inputs(c, world, 1000 + i)
        v = w.shape[0]
        k = v // world
        sl = slice(rank * k, rank * k + k)
        name = ", ".join(f"{kk}={vv}" for kk, vv in c.items() if kk != "dtype")
        name = f"{str(c['dtype'])[6:]}: {name}"
        try:
            opts = spec.LinearCrossEntropyOptions(
                reduction=c["reduction"], label_smoothing=c.get("label_smoothing", 0.0),
                z_loss=c.get("z_loss", 0.0), softcap=c.get("softcap"))
            f64 = lambda t: None if t is None else t.double().numpy()
            ref = spec.reference(f64(x), f64(w), y.numpy(), bias=f64(b), weight=f64(cw),
                                 options=opts, grad_output=f64(go), grad_lse=f64(gl))
            kw = {"chunk_size": c["chunk_size"]} if "chunk_size" in c else dict(chunk_kw)
            single = _run(c, x, w, b, y, cw, go, gl, dev)  # one device, the default backend
            vp = _run(c, x, w[sl], None if b is None else b[sl], y, cw if cw is None else cw[sl],
                      go, gl, dev, process_group=group, **kw)
            bad = []
            for key, out in vp.items():
                r = ref["loss"] if key == "loss" else ref[key]
                one = single[key]
                if key in ("dw", "db"):
                    r, one = r[sl], one[sl]
                if not np.isfinite(out).all():
                    bad.append(f"{key} not finite")
                    continue
                if not np.any(r):
                    if np.any(out):
                        bad.append(f"{key}: reference 0, got {np.abs(out).max():.3g}")
                    continue
                err, tol = _rel(out, r), max(2 * _rel(one, r), FLOOR[c["dtype"]])
                if err > tol:
                    bad.append(f"{key}: rel err {err:.3g} > tol {tol:.3g}")
            status = "FAIL" if bad else "PASS"
        except Exception as e:  # noqa: BLE001
            status, bad = "FAIL", [f"{type(e).__name__}: {e}"]
        # a case fails if it fails on any rank
        flag = torch.tensor([1.0 if bad else 0.0], device=dev)
        dist.all_reduce(flag, group=group)
        if flag.item() > 0:
            fails += 1
            status = "FAIL"
        log0(f"{status} vocab-parallel TP={world} {name}" + (f"  [rank {rank}: {bad}]" if bad else ""))
        if bad and rank != 0:
            print(f"FAIL rank {rank}: {name}: {bad}", flush=True)
    return fails


# ----------------------------------------------------------------------------- (b) FSDP2
class LM(nn.Module):
    def __init__(self, h, i, v, shards):
        super().__init__()
        torch.manual_seed(4321)
        self.inp = nn.Linear(h, h)
        self.mlp = lt.TiledMLP(lt.SwiGLUMLP(h, i), num_shards=shards)
        self.head = nn.Linear(h, v, bias=False)

    def forward(self, x, y, count=None, world=1):
        hid = self.mlp(self.inp(x))
        if count is None:
            return lt.linear_cross_entropy(hid, self.head.weight, y)
        return lt.linear_cross_entropy(hid, self.head.weight, y, reduction="sum") / count * world


def check_fsdp(dev, small):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    h, i, v, b, t = (16, 24, 37, 2, 10) if small else (256, 704, 4099, 2, 512)

    def data(r):
        g = torch.Generator().manual_seed(50 + r)
        x = torch.randn(b, t, h, generator=g)
        y = torch.randint(0, v, (b, t), generator=g)
        y[torch.rand(b, t, generator=g) < 0.2 + 0.3 * r] = -100
        return x.to(dev), y.to(dev)

    all_data = [data(r) for r in range(world)]
    ref_model = LM(h, i, v, 3).to(dev)
    ref_model(torch.cat([d[0] for d in all_data]), torch.cat([d[1] for d in all_data])).backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}

    model = LM(h, i, v, 3).to(dev)
    mesh = init_device_mesh(dev.type, (world,))
    fully_shard(model.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = all_data[rank]
    model(x, y, lt.global_token_count(y), world).backward()
    worst, bad = 0.0, []
    for n, p in model.named_parameters():
        g = p.grad.full_tensor()
        e = _rel(g.double().cpu().numpy(), ref[n].double().cpu().numpy())
        worst = max(worst, e)
        if not (e <= 1e-4 and torch.isfinite(g).all()):  # fp32: summation order only
            bad.append(f"{n}: rel err {e:.3g}")
    flag = torch.tensor([1.0 if bad else 0.0], device=dev)
    dist.all_reduce(flag)
    status = "FAIL" if flag.item() > 0 else "PASS"
    log0(f"{status} FSDP2 x{world} TiledMLP + fused loss grads vs 1 process "
         f"(worst rel err {worst:.2e}) {bad if bad else ''}")
    return int(flag.item() > 0), worst


# ----------------------------------------------------------------------------- (c) timing
def _time(fn, dev, reps, warmup):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        common.synchronize(str(dev))
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        common.synchronize(str(dev))
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), ts


def time_scaling(dev, small, reps, warmup):
    rank, world = dist.get_rank(), dist.get_world_size()
    n, h, v = (256, 64, 1000 * world) if small else (16384, 4096, 128256)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    assert v % world == 0, "V must split evenly"
    k = v // world
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, h, generator=g)).to(dev, dt).requires_grad_()
    w_full_rows = torch.randn(k, h, generator=torch.Generator().manual_seed(1 + rank))
    w = (w_full_rows * (3.0 / h ** 0.5)).to(dev, dt).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.1] = -100
    y = y.to(dev)
    rows = {}

    def step(**kw):
        def fn():
            x.grad = w.grad = None
            lt.linear_cross_entropy(x, w, y, **kw).backward()
        return fn

    cands = [("vocab-parallel", dict(process_group=dist.group.WORLD))]
    if world == 1:
        cands.append(("single-gpu-default-backend", {}))
    for name, kw in cands:
        try:
            common.free_memory(str(dev))
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            med, ts = _time(step(**kw), dev, reps, warmup)
            peak = (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else None
            rows[name] = dict(median_ms=med, times_ms=ts, peak_bytes_over_inputs=peak)
        except Exception as e:  # noqa: BLE001
            rows[name] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    return dict(n=n, h=h, v=v, v_local=k, dtype=str(dt), tp=world, per_rank=gathered)


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(common.RESULTS_DIR))
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    devtype = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if devtype == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if devtype == "cuda" else "gloo")
    world = dist.get_world_size()
    t0 = time.time()
    fails = check_equality(dev, dist.group.WORLD, {})
    f2, fsdp_err = check_fsdp(dev, args.small)
    fails += f2
    log0(f"checks done in {time.time() - t0:.1f} s, {fails} failure(s)")
    timing = time_scaling(dev, args.small, args.reps, args.warmup)
    env = common.environment(str(dev) if devtype == "cuda" else None)
    if dist.get_rank() == 0:
        rec = dict(benchmark="vocab_parallel", environment=env, world=world,
                   checks=dict(failures=fails, fsdp_worst_rel_err=fsdp_err), timing=timing)
        out = Path(args.out) / f"{common.device_slug(env)}-vocab-parallel-tp{world}.json"
        common.write_json(out, rec)
        print(f"wrote {out}")
        _print_table(Path(args.out), common.device_slug(env))
    dist.destroy_process_group()
    sys.exit(1 if fails else 0)


def _print_table(out_dir, slug):
    rows = []
    for p in sorted(out_dir.glob(f"{slug}-vocab-parallel-tp*.json")):
        t = json.loads(p.read_text())["timing"]
        for name in t["per_rank"][0]:
            ms = [r[name].get("median_ms") for r in t["per_rank"]]
            mem = [r[name].get("peak_bytes_over_inputs") for r in t["per_rank"]]
            if None in ms:
                rows.append([f"TP={t['tp']}", name, "error", "-"])
                continue
            rows.append([f"TP={t['tp']}", name, common.fmt_ms(max(ms)),
                         common.fmt_bytes(max(mem)) if None not in mem else "-"])
    print(common.format_table(["tp", "candidate", "fwd+bwd ms (slowest rank)",
                               "peak mem/GPU over inputs"], rows))


if __name__ == "__main__":
    main()
