"""Helpers several test files share: closeness checks against the float64 spec, the JSD
formulation the torch oracle and the naive torch backend both use, the jaxpr walk, and the
GPU checks (CUDA-graph capture of a training step, no host syncs).

Frameworks are imported inside the functions: a test file that needs only one of them, or
none (the spec tests), imports this module without the others."""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys

import numpy as np

import harness
from harness import rel_err


# ============================================================================== closeness
def assert_close_abs(name, got, want, *, rtol, atol):
    """max |got - want| <= rtol · max |want| + atol, and nothing may be NaN or infinite."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.isfinite(want).all(), f"{name}: the oracle itself is not finite"
    assert np.isfinite(got).all(), f"{name}: not finite"
    err = np.max(np.abs(got - want), initial=0.0)
    scale = np.max(np.abs(want), initial=0.0)
    assert err <= rtol * scale + atol, \
        f"{name}: max abs err {err:.3g} > {rtol:g} x scale {scale:.3g} + {atol:g}"


def assert_close_rel(a, r, tol):
    """``a`` finite and within relative (norm) error ``tol`` of the float64 ``r``."""
    a = np.asarray(a, np.float64)
    assert np.isfinite(a).all()
    assert rel_err(a, r) <= tol, rel_err(a, r)


def pick_cases(cases, wanted, what="the case matrix"):
    """``{name: the first case where wanted[name](case)}``; fails when a name matches none."""
    out = {}
    for name, pred in wanted.items():
        match = [c for c in cases if pred(c)]
        assert match, f"{what} changed: no {name!r} case; update _pick"
        out[name] = match[0]
    return out


# ============================================================================== JSD in torch
def torch_jsd_loss(zs, zt, y, mask, *, beta, temperature, hard_loss_weight, ignore_index,
                   reduction):
    """``(loss, per-token loss)`` of Liger's formulation on materialized logits: ``F.kl_div``
    with ``log_target``, log M by logsumexp, ``F.cross_entropy`` for the hard-label term;
    ``mask`` (1 = counted) in the logits' float dtype."""
    import torch
    import torch.nn.functional as F
    logq = F.log_softmax(zs / temperature, dim=-1)
    logp = F.log_softmax(zt / temperature, dim=-1)
    kl = lambda inp, tgt: F.kl_div(inp, tgt, reduction="none", log_target=True).sum(-1)
    b = beta
    if b == 0:
        tok = kl(logq, logp)
    elif b == 1:
        tok = kl(logp, logq)
    else:
        logm = torch.logsumexp(torch.stack([logq + math.log(1 - b), logp + math.log(b)]), dim=0)
        tok = b * kl(logm, logp) + (1 - b) * kl(logm, logq)
    if hard_loss_weight:
        tok = tok + hard_loss_weight * F.cross_entropy(
            zs, y, ignore_index=ignore_index, reduction="none")
    tok = tok * mask
    if reduction == "none":
        loss = tok
    elif reduction == "sum":
        loss = tok.sum()
    else:
        loss = tok.sum() / mask.sum().clamp_min(1.0)
    return loss, tok


# ============================================================================== JAX
def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)


def gemm_shapes(jaxpr):
    """The operand and result shapes of every ``dot_general`` in a jaxpr (nested ones too)."""
    return [tuple(v.aval.shape) for e in jaxpr_eqns(jaxpr) if e.primitive.name == "dot_general"
            for v in (*e.invars, *e.outvars)]


# ============================================================================== row padding
def filled_rows_buffers(monkeypatch, fill):
    """Make ``_torch_common.rows_buffer`` fill its buffers, padding included, with ``fill``;
    returns the (cols, load_cols) pairs the row kernels are launched with."""
    import torch

    from logitless import _torch_common as common
    real_buffer, real_load = common.rows_buffer, common.load_cols
    loads = []

    def buffer(*args, **kwargs):
        b = real_buffer(*args, **kwargs)
        torch.as_strided(b, (b.shape[0], b.stride(0)), (b.stride(0), 1)).fill_(fill)
        return b

    def load_cols(cols, *bufs):
        loads.append((cols, real_load(cols, *bufs)))
        return loads[-1][1]
    monkeypatch.setattr(common, "rows_buffer", buffer)
    monkeypatch.setattr(common, "load_cols", load_cols)
    return loads


def assert_row_padding_never_counted(monkeypatch, compute):
    """``compute()`` -> tensors, run with the padding of every ``rows_buffer`` filled with 0,
    then with NaN: the row kernels must have had the padding in reach (a launch whose
    ``load_cols`` exceeds its columns), and the results must be finite and equal bit for bit."""
    import torch

    def run(fill):
        loads = filled_rows_buffers(monkeypatch, fill)
        out = compute()
        monkeypatch.undo()
        return out, loads

    zeros, loads = run(0.0)
    assert any(wide > cols for cols, wide in loads), loads
    junk, _ = run(float("nan"))
    for a, b in zip(junk, zeros):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ============================================================================== GPU
def check_cuda_graph_training(head, loss_fn, batches):
    """A training step of ``head`` (zero_grad, ``loss_fn(head.weight, *inputs)``, backward, an
    SGD step) over ``batches`` (tuples of tensors of equal shapes, copied into static input
    buffers before each step): eagerly, then by replaying the step captured once in a CUDA
    graph, each series from the same start. The losses and the final weight must agree. The
    batches should differ in what a capture could bake in (their values, which tokens are
    ignored, an all-ignored one), so that nothing derived on the host at capture time passes."""
    import torch
    weight = head.weight
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    static = [t.clone() for t in batches[0]]

    def load(batch):
        for buf, t in zip(static, batch):
            buf.copy_(t)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(weight, *static)
        loss.backward()
        opt.step()
        return loss

    w0 = weight.detach().clone()
    eager = []
    for batch in batches:
        load(batch)
        eager.append(step().detach().clone())
    w_eager = weight.detach().clone()
    with torch.no_grad():
        weight.copy_(w0)
    load(batches[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture, as CUDA graphs require
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.no_grad():
        weight.copy_(w0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    with torch.no_grad():
        weight.copy_(w0)
    replayed = []
    for batch in batches:
        load(batch)
        graph.replay()
        replayed.append(static_loss.detach().clone())
    torch.testing.assert_close(torch.stack(replayed), torch.stack(eager), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight, w_eager, rtol=1e-5, atol=1e-6)


def graph_batches(n, h, v, *, dtype, generator, extra=()):
    """Three (hidden, targets, *extra) batches for :func:`check_cuda_graph_training`: fresh
    values, ~20% then 100% of the tokens ignored (-100). ``extra`` are shapes of further
    float inputs (e.g. a teacher's hidden states)."""
    import torch
    out = []
    for ignored in (0.0, 0.2, 1.0):
        hid = torch.randn(n, h, generator=generator).to("cuda", dtype)
        y = torch.randint(0, v, (n,), generator=generator)
        y[torch.rand(n, generator=generator) < ignored] = -100
        more = [torch.randn(*s, generator=generator).to("cuda", dtype) for s in extra]
        out.append((hid, y.to("cuda"), *more))
    return out


@contextlib.contextmanager
def no_host_sync():
    """Inside, a host sync on the GPU raises (torch's sync debug mode); call once outside
    first, so that compiling and autotuning are not inside."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


class PeakLiveBytes:
    """Peak bytes of the storages that torch ops allocate inside the block, counted live
    (CPU too, where no allocator statistics exist): each op's outputs are tallied under a
    dispatch mode and freed when the last tensor on their storage dies. Storages that
    existed before (the inputs, and views of them) do not count."""

    def __init__(self, *preexisting):
        self.peak = self.live = 0
        self._refs = {}  # storage data_ptr -> [tensors alive, nbytes]
        self._old = {t.untyped_storage().data_ptr() for t in preexisting}

    def _release(self, key):
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]

    def __enter__(self):
        import torch
        import weakref
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if not isinstance(t, torch.Tensor):
                        continue
                    key = t.untyped_storage().data_ptr()
                    if key in outer._old or t.untyped_storage().nbytes() == 0:
                        continue
                    ref = outer._refs.setdefault(key, [0, t.untyped_storage().nbytes()])
                    if ref[0] == 0:
                        outer.live += ref[1]
                        outer.peak = max(outer.peak, outer.live)
                    ref[0] += 1
                    weakref.finalize(t, outer._release, key)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


# ============================================================================ gloo ranks
def _free_port():
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank, body, world, port, out_dir, args, torch_interpret, backend="gloo"):
    import os
    import traceback

    import torch
    import torch.distributed as dist
    if not torch_interpret:  # the torch formulas instead of the (slow) Triton interpreter
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    res = {}
    try:
        res = body(rank, world, *args)
    except Exception:  # noqa: BLE001 - reported by the parent
        res = {"crash": traceback.format_exc()}
    finally:
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        # every rank done before any tears its gloo pairs down: a rank whose peer closed
        # first can die in gloo's threads ("terminate called without an active exception",
        # SIGABRT: seen twice in a row in the thirty-fourth session, not reproduced since)
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def run_gloo_ranks(body, world, out_dir, *args, triton_interpret=False, backend="gloo"):
    """Run ``body(rank, world, *args) -> dict`` in ``world`` gloo processes on this CPU (or,
    ``backend="nccl"``, one process per GPU, rank r on ``cuda:r``); the ranks' dicts, in rank
    order. A rank that raises fails the caller with its traceback. ``body`` must be a
    module-level function (it is pickled into the spawned processes)."""
    import os

    import torch
    import torch.multiprocessing as mp
    mp.spawn(_gloo_rank, args=(body, world, _free_port(), str(out_dir), args, triton_interpret,
                               backend),
             nprocs=world, join=True)
    res = [torch.load(os.path.join(str(out_dir), f"rank{r}.pt"), weights_only=False)
           for r in range(world)]
    for r in res:
        assert "crash" not in r, r["crash"]
    return res


def run_jax_worker(script: str, devices: int = 4, args=()) -> dict:
    """Run ``tests/<script> *args`` in a subprocess with ``devices`` host CPU devices (JAX
    fixes its device count when it initialises, and this pytest process has initialised it
    already) and the session's seed; returns the JSON object its last stdout line holds."""
    env = dict(os.environ, LOGITLESS_TEST_SEED=str(harness.SEED),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +  # conftest's CPU flags too
                          f" --xla_force_host_platform_device_count={devices}").strip(),
               JAX_PLATFORMS="cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.join(here, script), *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == devices, res
    return res
