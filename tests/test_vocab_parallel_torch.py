"""Vocab-parallel linear cross-entropy on torch.distributed: 2 and 4 gloo processes (CPU; the
4-process group where the kernels are not interpreted, see ``WORLDS``).

Each rank holds a slice of W (and of the bias and class weights); loss, lse, dX and the
rank's dW/db slices must equal the float64 spec reference computed on the whole W, within the
shared harness's rule (``harness.compare``: 2x the naive single-device path's error in the
case dtype, per-dtype floor, NaN never passes, exact zeros matched exactly). The cases cover
every option and reduction, fp32 and bf16, several chunks, an all-ignored batch, a rank owning
none of the targets, equal, uneven and permuted splits (rank order != vocab order), plus the
error paths. All cases of one world size run inside one spawned group (start-up dominates).
"""
import dataclasses
import os
import re
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

import harness
import op_linear_cross_entropy as op
from backends_torch import naive_torch
from helpers import run_gloo_ranks

EVERYTHING = dict(bias=True, class_weight=True, label_smoothing=0.2, z_loss=1e-2, softcap=5.0,
                  lse_grad=True)


def _cases():
    base = dict(n=37, h=33)
    out = []
    for dtype in ("float32", "bfloat16"):
        for red in ("mean", "sum", "none"):
            out.append(op.Case(**base, v=97, dtype=dtype, reduction=red))
            out.append(op.Case(**base, v=96, dtype=dtype, reduction=red, **EVERYTHING))
    for opt in (dict(bias=True), dict(class_weight=True), dict(label_smoothing=0.1),
                dict(z_loss=1e-3), dict(softcap=4.0), dict(lse_grad=True),
                dict(class_weight=True, label_smoothing=0.3)):
        out.append(op.Case(**base, v=97, **opt))
    out += [
        op.Case(n=1, h=16, v=61, ignore="none", **EVERYTHING),                  # N = 1
        op.Case(n=130, h=24, v=211, dtype="bfloat16", chunk_size=48, **EVERYTHING),  # chunks
        op.Case(n=130, h=24, v=211, reduction="none", chunk_size=32, class_weight=True),
    ]
    for red in ("mean", "sum", "none"):  # every token ignored: zeros, no NaN
        out.append(op.Case(**base, v=97, reduction=red, ignore="all",
                           **{**EVERYTHING, "lse_grad": False}))
    out.append(op.Case(**base, v=97, dtype="bfloat16", ignore="all", **EVERYTHING))
    return out


def _splits(v, world):
    """(name, per-rank (start, size)) vocab splits of [0, v) for ``world`` ranks."""
    out = []
    if v % world == 0:
        out.append(("equal", None))  # defaults: vocab_start_index / vocab_size left out
    # uneven: the first rank holds 1 class, the rest share the remainder unevenly
    sizes = [1] + [0] * (world - 1)
    rest = v - 1
    for r in range(1, world):
        sizes[r] = rest // (world - r) + (r % 2)
        rest -= sizes[r]
    sizes[-1] += rest
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    out.append(("uneven", list(zip(starts, sizes))))
    # permuted: rank r holds the slice of rank (r + 1) % world of the uneven split
    perm = [(starts[(r + 1) % world], sizes[(r + 1) % world]) for r in range(world)]
    out.append(("permuted", perm))
    return out


def _no_target_shard(inp, start, size):
    """Targets moved out of [start, start+size): that rank owns none of them."""
    y = inp.y.copy()
    hit = (y >= start) & (y < start + size)
    y[hit] = (start + size) % (inp.w.shape[0]) if size < inp.w.shape[0] else -100
    return dataclasses.replace(inp, y=y)


def _run_vp(case, inp, rank, world, split, group):
    import logitless.torch as lt
    from backends_torch import _torch_collect, _torch_inputs
    x, w, b, y, cw, g, gl = _torch_inputs(case, inp)
    v = w.shape[0]
    if split is None:
        k = v // world
        start, size, kw = rank * k, k, {}
    else:
        start, size = split[rank]
        kw = dict(vocab_start_index=start, vocab_size=v)
    sl = slice(start, start + size)
    w_l = w.detach()[sl].clone().requires_grad_()
    b_l = None if b is None else b.detach()[sl].clone().requires_grad_()
    cw_l = None if cw is None else cw[sl].contiguous()
    tuning = {"chunk_size": case.chunk_size} if case.chunk_size else {}
    loss, lse = lt.linear_cross_entropy(
        x, w_l, y, linear_bias=b_l, weight=cw_l, reduction=case.reduction,
        label_smoothing=case.label_smoothing, z_loss=case.z_loss, softcap=case.softcap,
        return_lse=True, process_group=group, **kw, **tuning)
    return _torch_collect(case, loss, lse, x, w_l, b_l, g, gl), sl


def _variants(world, salt=0):
    """Every (id, case, inputs, split) run in a group of ``world`` ranks, in one order, on the
    draw ``salt``."""
    for case in _cases():
        inp = op.make_inputs(case, salt)
        for split_name, split in _splits(case.v, world):
            yield f"{case.id}-{split_name}", case, inp, split
            if split is not None and case.ignore == "some" and case.n > 1:
                # the rank holding the largest slice owns none of the targets
                s0, n0 = max(split, key=lambda t: t[1])
                yield (f"{case.id}-{split_name}-no-target-shard", case,
                       _no_target_shard(inp, s0, n0), split)


def _check_all(rank, world, group, salt=0, only=None):
    """{id: (outputs, this rank's vocab slice)} or {id: traceback}, for the draw ``salt`` (the
    ids in ``only``, if given)."""
    out = {}
    for cid, case, inp, split in _variants(world, salt):
        if only is not None and cid not in only:
            continue
        try:
            res, sl = _run_vp(case, inp, rank, world, split, group)
            out[cid] = (res, (sl.start, sl.stop))
        except Exception:  # noqa: BLE001 - reported by the parent
            out[cid] = traceback.format_exc(limit=4)
    return out


def _check_errors(rank, world, group):
    """Error paths inside the group; returns the messages seen (the parent asserts on them)."""
    import logitless.torch as lt
    msgs = {}
    x = torch.randn(5, 8)
    w = torch.randn(6, 8)
    y = torch.randint(0, 6 * world, (5,))
    try:  # a slice outside [0, vocab_size): local, raised before any collective
        lt.linear_cross_entropy(x, w, y, process_group=group, vocab_start_index=6 * world - 3)
    except ValueError as e:
        msgs["range"] = str(e)
    try:  # every rank claims start 0: the slices overlap; caught after the gather, on all ranks
        lt.linear_cross_entropy(x, w, y, process_group=group, vocab_start_index=0,
                                vocab_size=6 * world)
    except RuntimeError as e:
        msgs["tiling"] = str(e)
    try:
        lt.linear_cross_entropy(x, w, y, process_group=group, backend="triton")
    except ValueError as e:
        msgs["backend"] = str(e)
    try:
        lt.linear_cross_entropy(x, w, y, process_group="world")
    except TypeError as e:
        msgs["type"] = str(e)
    try:  # a global target beyond V: the front door's target check with the global V
        lt.linear_cross_entropy(x, w, torch.full((5,), 6 * world), process_group=group)
    except RuntimeError as e:
        msgs["target"] = str(e)
    return msgs


def _check_module_and_count(rank, world, group):
    """The module form with process_group, and global_token_count, against local math."""
    import logitless.torch as lt
    g = torch.Generator().manual_seed(harness.SEED + 7)
    x = torch.randn(9, 8, generator=g)
    w = torch.randn(4 * world, 8, generator=g)
    y = torch.randint(0, 4 * world, (9,), generator=g)
    y[::3] = -100
    full = lt.linear_cross_entropy(x, w, y, reduction="sum")
    mod = lt.LinearCrossEntropyLoss(reduction="sum", process_group=group)
    part = mod(x, w[4 * rank:4 * rank + 4], y)
    # every rank counts its own tokens: here rank r ignores its first r tokens too
    y_r = y.clone()
    y_r[:rank] = -100
    count = lt.global_token_count(y_r, process_group=group)
    expected = sum(int(((y != -100) & (torch.arange(9) >= r)).sum()) for r in range(world))
    cw = torch.rand(4 * world, generator=g) + 0.5
    wcount = lt.global_token_count(y, weight=cw, process_group=group)
    wexpected = world * float((cw[torch.where(y != -100, y, 0)] * (y != -100)).sum())
    return dict(module=(float(part), float(full)), count=(float(count), expected),
                count_dtype=str(count.dtype), wcount=(float(wcount), wexpected))


def _check_uneven_budget_and_autocast(rank, world, group):
    """(1) Uneven slices with a ``memory_budget``: the ranks' token-chunk plans (and with them
    the backward's per-chunk dX all-reduces) must pair up; planned on V_local they did not
    (a gloo abort, an NCCL hang). (2) Under autocast, class weights with label smoothing and a
    large common logit offset: the fp32 loss math must not be re-cast to bf16 by autocast.
    (3) Label smoothing beside a class masked by a −inf bias (on rank 0's slice): per-token
    losses inf for kept tokens, 0 for ignored ones (were NaN: the mask times a −inf sum)."""
    import logitless.torch as lt
    g = torch.Generator().manual_seed(harness.SEED + 11)
    v, n = 6 * world + 1, 40
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    w = torch.randn(v, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=g)
    start, size = dict(_splits(v, world))["uneven"][rank]
    sl = slice(start, start + size)
    xr = x.clone().requires_grad_()
    want = lt.linear_cross_entropy(xr, w, y, reduction="sum")
    want.backward()
    xp = x.clone().requires_grad_()
    # 8 tokens of the widest slice: with V_local planning rank 0 (one class) took all 40 at once
    got = lt.linear_cross_entropy(xp, w[sl], y, reduction="sum", process_group=group,
                                  vocab_start_index=start, vocab_size=v,
                                  memory_budget=8 * 16 * (v // world + 1))
    got.backward()
    budget = (abs(float(got - want)) / abs(float(want)),
              float((xp.grad - xr.grad).abs().max() / xr.grad.abs().max()))

    v, h = 64 * world, 32
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g)
    b = torch.full((v,), 20.0)  # softmax-invariant, but bf16 sums of c·w lose it
    y = torch.randint(0, v, (n,), generator=g)
    cw = torch.rand(v, generator=g) + 0.5
    sl = slice(rank * 64, rank * 64 + 64)
    kw = dict(label_smoothing=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        single = lt.linear_cross_entropy(x, w, y, linear_bias=b, weight=cw, **kw)
        vp = lt.linear_cross_entropy(x, w[sl], y, linear_bias=b[sl], weight=cw[sl].contiguous(),
                                     process_group=group, **kw)
    masked_b = b.clone()
    masked_b[0] = -float("inf")
    y_m = torch.where(torch.arange(n) % 3 == 1, -100, y.clamp_min(1))
    per_tok = lt.linear_cross_entropy(x, w[sl], y_m, linear_bias=masked_b[sl],
                                      process_group=group, reduction="none", **kw)
    return dict(budget=budget, autocast=abs(float(vp - single)) / abs(float(single)),
                masked=(per_tok.tolist(), (y_m != -100).tolist()))


# (V, per-rank (start, size)) splits holding empty slices: V below the group size, an empty
# slice where the next one starts, at the end, inside another's range, ranks out of V order
_EMPTY_SPLITS = {
    2: [(1, [(0, 1), (1, 0)]), (7, [(0, 0), (0, 7)]), (7, [(0, 7), (7, 0)])],
    4: [(3, [(0, 1), (1, 1), (2, 1), (3, 0)]), (7, [(2, 0), (0, 2), (2, 5), (7, 0)]),
        (7, [(0, 3), (5, 0), (3, 4), (3, 0)])],
}


def _check_empty_slices(rank, world):
    """Splits where some rank holds no class (V_local = 0), float64, every option, several
    chunks: loss, lse, dX and the rank's dW/db slice against the single-device backend.
    {split id: (max relative error, this rank's dW shape)} or {split id: traceback}. Its own
    group with a short timeout: a rank that fails alone before the collectives (as they did)
    must not leave the others waiting for gloo's 30 minutes."""
    import datetime

    import logitless.torch as lt
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=20))
    out = {}
    for k, (v, split) in enumerate(_EMPTY_SPLITS[world]):
        for opt_id, opts in enumerate((
                dict(reduction="mean", label_smoothing=0.1, z_loss=1e-2, softcap=5.0,
                     bias=True, class_weight=True),
                dict(reduction="none"))):
            cid = f"split{k}-opts{opt_id}"
            try:
                g = torch.Generator().manual_seed(harness.SEED + 100 * k + opt_id)
                n, h = 11, 6
                x = torch.randn(n, h, generator=g, dtype=torch.float64)
                w = torch.randn(v, h, generator=g, dtype=torch.float64)
                b = torch.randn(v, generator=g, dtype=torch.float64) if opts.get("bias") else None
                cw = torch.rand(v, generator=g, dtype=torch.float64) + 0.5 \
                    if opts.get("class_weight") else None
                y = torch.randint(0, v, (n,), generator=g)
                y[::4] = -100
                g_out = torch.randn(n, generator=g, dtype=torch.float64)
                g_lse = torch.randn(n, generator=g, dtype=torch.float64)
                kw = {key: val for key, val in opts.items() if key not in ("bias", "class_weight")}
                start, size = split[rank]
                sl = slice(start, start + size)

                def run(w_, b_, cw_, **extra):
                    xx = x.clone().requires_grad_()
                    ww = w_.clone().requires_grad_()
                    bb = None if b_ is None else b_.clone().requires_grad_()
                    loss, lse = lt.linear_cross_entropy(xx, ww, y, linear_bias=bb, weight=cw_,
                                                        return_lse=True, chunk_size=4, **kw,
                                                        **extra)
                    up = g_out if kw["reduction"] == "none" else g_out[0]
                    torch.autograd.backward([loss, lse], [up, g_lse])
                    return [loss, lse, xx.grad, ww.grad] + ([] if bb is None else [bb.grad])

                want = run(w, b, cw, backend="torch")
                got = run(w[sl], None if b is None else b[sl],
                          None if cw is None else cw[sl].contiguous(), process_group=group,
                          vocab_start_index=start, vocab_size=v)
                want[3:] = [t[sl] for t in want[3:]]  # this rank's slices of dW, db
                err = max(float((a - e).abs().max() / e.abs().max().clamp_min(1e-300))
                          if e.numel() else float(a.shape != e.shape)
                          for a, e in zip(got, want))
                out[cid] = (err, tuple(got[3].shape))
            except Exception:  # noqa: BLE001 - reported by the parent
                out[cid] = traceback.format_exc(limit=4)
    return out


def _check_empty_rank_bad_vectors(rank, world):
    """The rank with an empty slice (V below the group size) gives a (1,) class-weight or bias
    vector: {what: "Type: message"} on that rank, nothing on the others, which stay out (the
    error must come before any collective, or the empty rank would wait in the forward's
    all_gather until its group's timeout). A (1,) class weight had been taken for the slice,
    changing every rank's smoothed loss; a (1,) bias had been ignored."""
    import datetime

    import logitless.torch as lt
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=10))
    v, split = _EMPTY_SPLITS[world][0]
    start, size = split[rank]
    if size:
        return {}
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, v, (5,))
    w = torch.randn(0, 4, dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    msgs = {}
    for what, kw in (("weight", dict(weight=one, label_smoothing=0.2)),
                     ("linear_bias", dict(linear_bias=one))):
        try:
            lt.linear_cross_entropy(x, w, y, process_group=group, vocab_start_index=start,
                                    vocab_size=v, **kw)
            msgs[what] = "no error"
        except Exception as e:  # noqa: BLE001 - the parent checks type and message
            msgs[what] = f"{type(e).__name__}: {e}"
    return msgs


def _check_refusals(rank, world, group):
    """create_graph=True, and a rank outside the group: {what: "Type: message"} per rank."""
    import logitless.torch as lt
    msgs = {}
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    y = torch.randint(0, 3 * world, (5,))
    try:
        loss = lt.linear_cross_entropy(x, w, y, process_group=group)
        torch.autograd.grad(loss, x, create_graph=True)
        msgs["double"] = "no error"
    except Exception as e:  # noqa: BLE001 - the parent checks type and message
        msgs["double"] = f"{type(e).__name__}: {e}"
    # new_group on every rank; the last rank alone is in it, the others get its sentinel
    alone = dist.new_group([world - 1])
    if rank != world - 1:
        try:
            lt.linear_cross_entropy(x, w, y, process_group=alone)
            msgs["non_member"] = "no error"
        except Exception as e:  # noqa: BLE001
            msgs["non_member"] = f"{type(e).__name__}: {e}"
    return msgs


def _worker(rank, world):
    group = dist.group.WORLD
    return dict(cases=_check_all(rank, world, group), errors=_check_errors(rank, world, group),
                module=_check_module_and_count(rank, world, group),
                uneven=_check_uneven_budget_and_autocast(rank, world, group),
                refusals=_check_refusals(rank, world, group),
                empty=_check_empty_slices(rank, world),
                empty_bad=_check_empty_rank_bad_vectors(rank, world))


def _redraw_worker(rank, world, only):
    """The cases ``only`` on the harness's confirming draws: {salt: {id: ...}}."""
    return {salt: _check_all(rank, world, dist.group.WORLD, salt, only)
            for salt in harness.REDRAW_SALTS}


def _judge(world, res, salt, only=None):
    """{id: failure message} of the draw ``salt`` (ranks' results ``res``: {id: ...} each),
    each tagged with whether it missed the tolerance only."""
    failures = {}
    for cid, case, inp, _ in _variants(world, salt):
        if only is not None and cid not in only:
            continue
        per_rank = [r[cid] for r in res]
        errs = [p for p in per_rank if isinstance(p, str)]
        if errs:
            failures[cid] = (False, errs[0])
            continue
        ref, naive = op.reference(case, inp), naive_torch(case, inp)
        full = {k: np.zeros_like(ref[k]) for k in ("dw", "db") if k in ref}
        covered = np.zeros(case.v, int)
        try:
            for out, (a, b) in per_rank:
                covered[a:b] += 1
                for k in full:
                    full[k][a:b] = out[k]  # this rank's slice, shape (b - a, ...)
                harness.compare(case, {k: out[k] for k in out if k not in full},
                                {k: ref[k] for k in ref if k not in full},
                                {k: naive[k] for k in naive if k not in full})
            assert (covered == 1).all(), f"slices do not tile [0, V): {covered}"
            harness.compare(case, full, {k: ref[k] for k in full},
                            {k: naive[k] for k in full})
        except harness.ToleranceExceeded as e:
            failures[cid] = (True, str(e))
        except AssertionError as e:
            failures[cid] = (False, str(e))
    return failures


# CI time: 4 gloo ranks on a 2-core CI machine took ~26 s and slowed the other xdist worker
# beside them; off a GPU the 2-rank group runs (its splits are uneven and permuted too), the
# GPU runs (benchmarks/gpu_tests.sh) and LOGITLESS_FULL_MATRIX=1 take both
WORLDS = [2] if harness.interpreted() else [2, 4]


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def results(request, tmp_path_factory):
    world = request.param
    os.environ["LOGITLESS_TEST_SEED"] = str(harness.SEED)  # every rank draws the same inputs
    return world, run_gloo_ranks(_worker, world, tmp_path_factory.mktemp(f"vp{world}"),
                                 triton_interpret=True)


def test_vocab_parallel_equals_spec(results, tmp_path):
    """Per case: each rank's loss, lse and dX, and the dW/db assembled from the ranks' slices
    (the slices must tile [0, V)), against the float64 spec on the whole W. A case that misses
    only the tolerance is re-run on the harness's two confirming draws in a new group, and
    fails when either misses too (``harness.confirmed``'s 2-of-3 rule)."""
    world, res = results
    first = _judge(world, [r["cases"] for r in res], 0)
    failures = [f"{cid}: {msg}" for cid, (tol_only, msg) in first.items() if not tol_only]
    retry = {cid for cid, (tol_only, _) in first.items() if tol_only}
    if retry:
        again = run_gloo_ranks(_redraw_worker, world, tmp_path, sorted(retry),
                               triton_interpret=True)
        for salt in harness.REDRAW_SALTS:
            for cid, (_, msg) in _judge(world, [r[salt] for r in again], salt, retry).items():
                failures.append(f"{cid}: missed on 2 of 3 draws: salt 0: {first[cid][1]}; "
                                f"salt {salt}: {msg}")
    assert not failures, "\n".join(failures)
    assert sum(1 for _ in _variants(world)) >= 3 * len(_cases())


def test_vocab_parallel_errors(results):
    world, res = results
    for r in res:
        e = r["errors"]
        assert "vocab_start_index" in e["range"] and "vocab_size" in e["range"], e
        assert "do not tile" in e["tiling"], e
        assert "backend" in e["backend"], e
        assert "process_group" in e["type"], e
        assert "target out of range" in e["target"], e


def test_module_and_global_token_count(results):
    world, res = results
    for r in res:
        m = r["module"]
        part, full = m["module"]
        assert abs(part - full) <= 1e-5 * abs(full), m
        assert m["count"][0] == m["count"][1], m
        assert m["count_dtype"] == "torch.float32"
        assert abs(m["wcount"][0] - m["wcount"][1]) <= 1e-5 * m["wcount"][1], m


def test_uneven_slices_with_a_budget_and_autocast(results):
    world, res = results
    for r in res:
        u = r["uneven"]
        assert u["budget"][0] <= 1e-12 and u["budget"][1] <= 1e-12, u  # float64
        assert u["autocast"] <= 1e-6, u  # 7e-5 when autocast re-cast the smoothing sum
        loss, kept = u["masked"]
        assert all((val == float("inf")) if k else (val == 0.0) for val, k in zip(loss, kept)), \
            loss


def test_create_graph_is_refused_on_every_rank(results):
    """create_graph=True: the no-double-backward error every backend gives, on every rank
    (raised before the backward's collectives: none is left waiting). It was mm()'s
    "functions with out=... arguments don't support automatic differentiation"."""
    world, res = results
    for r in res:
        assert r["refusals"]["double"].startswith("RuntimeError: linear_cross_entropy has no "
                                                  "double backward"), r["refusals"]


def test_rank_outside_process_group_is_told_so(results):
    """new_group returns GroupMember.NON_GROUP_MEMBER (an int) on the ranks outside it: the
    error says the group does not contain this process (it said "got int")."""
    world, res = results
    for r in res[:-1]:
        msg = r["refusals"]["non_member"]
        assert msg.startswith("ValueError: process_group does not contain this process"), msg
    assert "non_member" not in res[-1]["refusals"]


def test_empty_vocab_slices(results):
    """Ranks holding no class (V below the group size, uneven splits): every rank joins the
    collectives and gets the single-device loss, lse, dX and its dW/db slice (a (0, H) dW on
    an empty rank). It failed in prepare on the empty rank ("V >= 1") while the others waited
    in the forward's all_gather (a hang under NCCL)."""
    world, res = results
    for rank, r in enumerate(res):
        assert len(r["empty"]) == 2 * len(_EMPTY_SPLITS[world])
        for cid, got in r["empty"].items():
            assert not isinstance(got, str), f"rank {rank} {cid}: {got}"
            err, dw_shape = got
            k = int(cid[len("split"):cid.index("-")])
            start, size = _EMPTY_SPLITS[world][k][1][rank]
            assert dw_shape == (size, 6), (rank, cid, dw_shape)
            assert err <= 1e-12, (rank, cid, err)


def test_empty_rank_refuses_vectors_that_are_not_empty(results):
    """On the rank with an empty slice, a (1,) class weight or bias is a ValueError naming the
    empty slice, raised before the forward's collective (the others stayed out: a rank that
    reached the all_gather would have timed out instead)."""
    world, res = results
    v, split = _EMPTY_SPLITS[world][0]
    for rank, r in enumerate(res):
        if split[rank][1]:
            assert r["empty_bad"] == {}, r["empty_bad"]
            continue
        assert sorted(r["empty_bad"]) == ["linear_bias", "weight"], r["empty_bad"]
        for what, msg in r["empty_bad"].items():
            assert msg.startswith(f"ValueError: {what}") and \
                "must have shape (V_local,) = (0,): this rank's vocabulary slice is empty" in msg, \
                (rank, what, msg)


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_prepare_on_an_empty_slice_wants_empty_vectors(layout):
    """prepare(empty_vocab=True) with a (V_local = 0) weight: (0,) bias and class weights are
    the slice's; any other shape is refused, naming the empty slice. It had checked them as
    a one-class slice: a (1,) vector passed, and a wrong one was told "(V,) = (1,)"."""
    from logitless import _torch_common as common
    x, y = torch.randn(3, 4), torch.randint(0, 5, (3,))
    w = torch.randn(0, 4) if layout == "vh" else torch.randn(4, 0)
    empty = torch.zeros(0)
    p = common.prepare(x, w, y, empty, empty, weight_layout=layout, empty_vocab=True)
    assert p.problem.v == 0 and p.bias.shape == (0,) and p.class_weight.shape == (0,)
    assert common.prepare(x, w, y, None, None, weight_layout=layout,
                          empty_vocab=True).problem.v == 0
    for bad in ((1,), (3,), (0, 0), ()):
        t = torch.zeros(bad)
        for name, args in (("linear_bias", (t, None)), ("weight (class weights)", (None, t)),
                           ("linear_bias", (t, t))):
            with pytest.raises(ValueError, match=re.escape(
                    f"{name} must have shape (V_local,) = (0,): this rank's vocabulary slice "
                    f"is empty (linear_weight has shape {tuple(w.shape)}), got {bad}")):
                common.prepare(x, w, y, *args, weight_layout=layout, empty_vocab=True)


@pytest.mark.parametrize("slices, v, ok", [
    ([(0, 0), (0, 7)], 7, True), ([(0, 7), (0, 0)], 7, True),     # empty beside [0, V)
    ([(0, 3), (5, 0), (3, 4)], 7, True),                             # empty inside a slice
    ([(0, 1), (1, 1), (2, 1), (3, 0)], 3, True),                     # V below the group
    ([(0, 4), (3, 4)], 7, False), ([(0, 3), (4, 3)], 7, False),      # overlap, gap
    ([(0, 0), (0, 0)], 0, False), ([(0, 7), (8, 0)], 7, False),      # V = 0, start past V
])
def test_tiling_assert(slices, v, ok):
    """The forward's device-side check of the gathered slices, alone (no process group)."""
    from logitless import vocab_parallel_torch as vp
    scal = torch.zeros(len(slices), 4, dtype=torch.float64)
    for r, (start, size) in enumerate(slices):
        scal[r, vp._S_VLOCAL], scal[r, vp._S_START], scal[r, vp._S_V] = size, start, v
    if ok:
        vp._assert_tiling(scal, v)
    else:
        with pytest.raises(RuntimeError, match="do not tile"):
            vp._assert_tiling(scal, v)


def test_process_group_needs_init():
    import logitless.torch as lt
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        lt.linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]),
                                process_group=object())
    with pytest.raises(ValueError, match="need process_group"):
        lt.linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]),
                                vocab_size=6)
    # no group, no distributed: the local count
    assert float(lt.global_token_count(torch.tensor([1, -100, 3]))) == 2.0
    # with class weights a stray label is an error, not weight[-1] (as in the loss)
    cw = torch.tensor([1.0, 2.0, 3.0, 10.0])
    assert float(lt.global_token_count(torch.tensor([0, 1, -100]), weight=cw)) == 3.0
    for bad in (-1, 4):
        with pytest.raises(RuntimeError, match="target out of range"):
            lt.global_token_count(torch.tensor([0, 1, bad, -100]), weight=cw)
