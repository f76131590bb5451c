"""GPU probe: one fwd+bwd step eager against the same step replayed from a CUDA graph, for
linear CE (Triton, fast and low-memory) and linear JSD (Triton) at the TARGETS shapes. A
replay has no host-side launch cost, so a gap between the two is GPU time lost to the host
(launch-bound stretches). Prints one JSON line per case."""
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import logitless.torch as lt  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.jsd_profile import inputs as jsd_inputs  # noqa: E402
from benchmarks.triton_probe import inputs as lce_inputs  # noqa: E402


def ms(fn, reps=10):
    return common.time_fn(fn, device="cuda", reps=reps, warmup=2).median_ms


def compare(name, step, params):
    def no_grads():
        for p in params:
            p.grad = None

    def eager():
        no_grads()
        step()
    eager()
    g = common.capture_cuda_graph(step, no_grads)
    rows = []
    for _ in range(2):  # interleaved: the clock drifts over a run
        rows.append((ms(eager), ms(g.replay)))
    print(json.dumps(dict(case=name, eager_ms=[r[0] for r in rows],
                          replay_ms=[r[1] for r in rows])), flush=True)
    del g
    torch.cuda.empty_cache()


def lce_cases():
    x, w, y = lce_inputs(16384, 4096, 128256)
    for kw in ({}, {"low_memory": True}):
        compare(f"lce {kw}", lambda kw=kw: lt.linear_cross_entropy(
            x, w, y, backend="triton", **kw).backward(), (x, w))


def jsd_case():
    xs, ws, xt, wt, y = jsd_inputs(8192, 4096, 128256)
    compare("jsd", lambda: lt.linear_jsd(xs, ws, xt, wt, y, backend="triton").backward(),
            (xs, ws))


def main():
    lce_cases()  # its tensors are freed on return
    torch.cuda.empty_cache()
    jsd_case()


if __name__ == "__main__":
    main()
