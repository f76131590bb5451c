"""Worker of tests/test_vocab_parallel_jax.py, run as a subprocess: XLA_FLAGS must give JAX 4
host devices before it initialises, which the pytest process (JAX already imported) cannot.

For 2 and 4 devices on a mesh axis "tp", each case runs ``jit(vjp)`` of ``shard_map`` of
``logitless.jax.linear_cross_entropy(..., axis_name="tp")`` (W, bias, class weights sharded
on V; x, labels replicated) and is compared with the float64 spec by the shared harness rule
(``harness.compare`` against the naive jnp path's error; a tolerance miss is re-checked on
fresh draws, ``harness.confirmed``). Prints one JSON line: the failures and the number of
checks; exit status 0 either way (the test asserts on the JSON). The argument picks the part:
``4`` (the 4-device case matrix) or ``2`` (2 devices, and the data-parallel count and label
checks), so that the test's two halves can run on two pytest-xdist workers at once.
"""
import json
import os
import sys
import traceback

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # the tests helpers, then the repo root

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import harness  # noqa: E402
import op_linear_cross_entropy as op  # noqa: E402
from backends_jax import _jax_inputs, _run_vjp, naive_jax  # noqa: E402

# jax >= 0.8 has jax.shard_map (keyword check_vma); older ones only the experimental module
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map

EVERYTHING = dict(bias=True, class_weight=True, label_smoothing=0.2, z_loss=1e-2, softcap=5.0,
                  lse_grad=True)


def cases():
    base = dict(n=37, h=33, v=96)
    out = []
    for dtype in ("float32", "bfloat16"):
        for red in ("mean", "sum", "none"):
            out.append(op.Case(**base, dtype=dtype, reduction=red))
            out.append(op.Case(**base, dtype=dtype, reduction=red, **EVERYTHING))
    for opt in (dict(bias=True), dict(class_weight=True), dict(label_smoothing=0.1),
                dict(z_loss=1e-3), dict(softcap=4.0), dict(lse_grad=True)):
        out.append(op.Case(**base, **opt))
    out += [op.Case(n=1, h=16, v=64, ignore="none", **EVERYTHING),
            op.Case(n=130, h=24, v=212, dtype="bfloat16", chunk_size=48, **EVERYTHING)]
    for red in ("mean", "none"):
        out.append(op.Case(**base, reduction=red, ignore="all",
                           **{**EVERYTHING, "lse_grad": False}))
    out.append(op.Case(**base, dtype="bfloat16", ignore="all", **EVERYTHING))
    return out


def no_target_shard(inp, ndev):
    """Targets of the last device's slice moved to class 0: that device owns none."""
    v = inp.w.shape[0]
    y = inp.y.copy()
    y[y >= v - v // ndev] = 0
    inp.y = y
    return inp


def run_vp(case, inp, mesh, check_vma=True):
    import logitless.jax as lj
    tuning = {"chunk_size": case.chunk_size} if case.chunk_size else {}

    def loss_and_lse(x, w, b, y, cw):
        args = [x, w, y] + [a for a in (b, cw) if a is not None]
        specs = (P(), P("tp", None), P()) + (P("tp"),) * (len(args) - 3)

        def local(x, w, y, *rest):
            rest = list(rest)
            b_l = rest.pop(0) if b is not None else None
            cw_l = rest.pop(0) if cw is not None else None
            out = lj.linear_cross_entropy(
                x, w, y, linear_bias=b_l, weight=cw_l, reduction=case.reduction,
                label_smoothing=case.label_smoothing, z_loss=case.z_loss, softcap=case.softcap,
                return_lse=case.lse_grad, axis_name="tp", **tuning)
            return out if case.lse_grad else (out, None)

        return shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P()),
                         check_vma=check_vma)(*args)

    return _run_vjp(case, loss_and_lse, _jax_inputs(case, inp))


def main(part):
    failures, checked = [], 0
    for ndev in (int(part),):
        mesh = Mesh(np.array(jax.devices()[:ndev]), ("tp",))
        # 2 devices: the cases with every option on, and the variants; 4 devices (each case
        # a compile of its own: CI time): the plain cases of every dtype and reduction, N = 1
        # and the chunked one (the code paths do not depend on the device count; the slices
        # do). A rank that owns no target ("-no-target-shard"): the cases with every option on.
        # check_vma=False (shard_map hands the rule 1/n of each cotangent and sums x's
        # itself; dW and db had come out divided by n): the cases with every option on in
        # float32, and the chunked bfloat16 one
        for case in (c for c in cases() if (c.label_smoothing == 0.2 if ndev == 2 else
                                            op.options_on(c) == 0 or c.n != 37)):
            for variant in ("", "-no-target-shard", "-unchecked") if ndev == 2 else ("",):
                everything = case.label_smoothing == 0.2 and case.ignore != "all"
                unchecked = everything and (case.dtype == "float32" or case.chunk_size)
                if (variant == "-no-target-shard" and not everything) or \
                        (variant == "-unchecked" and not unchecked):
                    continue
                cid = f"{ndev}dev-{case.id}{variant}"
                def check(salt, case=case, variant=variant, mesh=mesh, ndev=ndev):
                    inp = op.make_inputs(case, salt)
                    if variant == "-no-target-shard":
                        inp = no_target_shard(inp, ndev)
                    got = run_vp(case, inp, mesh, check_vma=variant != "-unchecked")
                    harness.compare(case, got, op.reference(case, inp), naive_jax(case, inp))

                try:
                    harness.confirmed(check)  # a tolerance miss: 2 of 3 draws must miss
                    checked += 1
                except Exception:  # noqa: BLE001 - reported to the test
                    failures.append(f"{cid}: {traceback.format_exc(limit=4)}")
    if part == "4":
        print(json.dumps(dict(failures=failures, checked=checked, devices=len(jax.devices()),
                              jax=jax.__version__)))
        return
    # the data-parallel count: psum over the axis of each device's labels
    import jax.numpy as jnp
    import logitless.jax as lj
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    labels = jnp.asarray(np.array([[1, -100, 2], [-100, -100, 3], [4, 5, 6], [-100] * 3]),
                         jnp.int32)
    count = shard_map(lambda l: lj.global_token_count(l[0], axis_name="dp"), mesh=mesh,
                      in_specs=P("dp"), out_specs=P())(labels)
    # narrow labels read as the loss reads them (as int32): uint8 156 is a class, not -100
    # wrapped (it had been counted as ignored), and with 256 class weights no uint8 label is
    # out of range (256 had wrapped to 0: every label "out of range", a NaN count); int8
    # labels against 200 class weights (200 had overflowed int8: an OverflowError)
    u8 = jnp.asarray(np.array([156, 200, 156, 3], np.uint8))
    i8 = jnp.asarray(np.array([-100, 5, 120, 3], np.int8))
    narrow_counts = [float(lj.global_token_count(u8)),
                     float(lj.global_token_count(u8, weight=jnp.ones(256))),
                     float(lj.global_token_count(i8, weight=jnp.ones(200)))]
    # labels closed over as a NumPy constant are concrete inside the mapped function: global
    # labels >= V_local must count as valid classes (no eager check against the local slice)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    rng = np.random.default_rng([harness.SEED, 99])
    x = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((10, 8)), jnp.float32)
    y_np = np.array([1, 9, 7, 3, -100, 8])
    closed = jax.jit(shard_map(lambda x, w: lj.linear_cross_entropy(x, w, y_np, axis_name="tp"),
                               mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P()))(x, w)
    plain = lj.linear_cross_entropy(x, w, jnp.asarray(y_np))
    concrete_err = float(abs(closed - plain) / abs(plain))
    # ... and a concrete label at or past the global V is a ValueError, as without axis_name
    bad_concrete = []
    for bad in (10, -1):
        y_bad = y_np.copy()
        y_bad[2] = bad
        try:
            jax.jit(shard_map(lambda x, w: lj.linear_cross_entropy(x, w, y_bad, axis_name="tp"),
                              mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P()))(x, w)
            bad_concrete.append(f"{bad}: no error")
        except ValueError as e:
            bad_concrete.append(f"{bad}: {e}")
    print(json.dumps(dict(failures=failures, checked=checked, count=float(count),
                          narrow_counts=narrow_counts,
                          concrete_labels_rel_err=concrete_err, bad_concrete=bad_concrete,
                          devices=len(jax.devices()), jax=jax.__version__)))


if __name__ == "__main__":
    main(sys.argv[1])
