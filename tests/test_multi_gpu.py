"""Ops on a GPU other than the current one (a ``device_map`` head or MLP on ``cuda:1`` while
``cuda:0`` is current). Triton launches on the *current* device's stream, so every op body must
make the tensors' device current; the JAX port behind the bridge must sync with the tensors'
device's stream. Each op runs on ``cuda:1`` twice, once with ``cuda:1`` current (the reference)
and once with ``cuda:0`` current, and both must give the same values. Needs two GPUs."""
import pytest
import torch

import logitless.torch as lt
from harness import SEED

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

N, H, I, V = 300, 64, 96, 1000


def _inputs(dev, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(SEED + 11)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dev, dtype)
    y = torch.randint(0, V, (N,), generator=g)
    y[torch.rand(N, generator=g) < 0.1] = -100
    return dict(x=r(N, H), w=r(V, H, scale=H ** -0.5), xt=r(N, H), wt=r(V, H, scale=H ** -0.5),
                y=y.to(dev), wg=r(I, H, scale=H ** -0.5), wu=r(I, H, scale=H ** -0.5),
                wd=r(H, I, scale=I ** -0.5))


def _ce(d, **kw):
    return lambda x, w: lt.linear_cross_entropy(x, w, d["y"], **kw)


def _jsd(d, **kw):
    return lambda x, w: lt.linear_jsd(x, w, d["xt"], d["wt"], d["y"], **kw)


def _mlp(d):
    mlp = lt.SwiGLUMLP(H, I, device=d["x"].device, dtype=d["x"].dtype)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(d["wg"])
        mlp.up_proj.weight.copy_(d["wu"])
        mlp.down_proj.weight.copy_(d["wd"])
    tiled = lt.TiledMLP(mlp, num_shards=3)

    def run(x, w):  # w (the CE head) unused: the MLP's own weights get the gradients
        return (tiled(x).float() * torch.arange(H, device=x.device)).sum() / N
    run.params = list(mlp.parameters())
    return run


CASES = {
    "ce-triton": lambda d: _ce(d, backend="triton"),
    "ce-triton-lowmem": lambda d: _ce(d, backend="triton", low_memory=True),
    "ce-triton-none": lambda d: _ce(d, backend="triton", reduction="none"),
    "ce-pallas-bridge": lambda d: _ce(d, backend="pallas"),
    "jsd-triton": lambda d: _jsd(d, backend="triton"),
    "jsd-pallas-bridge": lambda d: _jsd(d, backend="pallas"),
    "tiled-swiglu": _mlp,
}


def _run(case, current):
    dev = torch.device("cuda:1")
    with torch.cuda.device(current):
        d = _inputs(dev)
        fn = CASES[case](d)
        x, w = d["x"].requires_grad_(), d["w"].requires_grad_()
        out = fn(x, w)
        leaves = [x] + getattr(fn, "params", [w])
        grads = torch.autograd.grad(out.float().sum(), leaves)
        res = [out.detach()] + [g.detach() for g in grads]
        torch.cuda.synchronize(dev)
    return [t.float().cpu() for t in res]


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_on_a_gpu_that_is_not_current(case):
    if "pallas" in case:
        pytest.importorskip("jax")
    ref = _run(case, torch.device("cuda:1"))
    got = _run(case, torch.device("cuda:0"))
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.isfinite(a).all(), (case, i)
        # same kernels, same inputs, same device: equal up to cuBLAS's split-K choices
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-5, msg=f"{case}: output {i}")


def test_causal_lm_loss_with_the_head_on_another_gpu():
    """device_map="auto" may put the final norm on cuda:0 and lm_head on cuda:1: the hidden
    states go to the head's device (as accelerate's hook on lm_head moves them), and the
    gradient comes back to cuda:0."""
    from logitless.integrations.transformers import causal_lm_loss
    d = _inputs(torch.device("cuda:1"))
    hidden = d["x"].reshape(3, N // 3, H).to("cuda:0").requires_grad_()
    labels = torch.randint(0, V, (3, N // 3), device="cuda:0")
    loss = causal_lm_loss(hidden, d["w"], labels)
    want = causal_lm_loss(hidden.detach().to("cuda:1"), d["w"], labels.to("cuda:1"))
    torch.testing.assert_close(loss.cpu(), want.cpu(), rtol=1e-5, atol=0)
    (g,) = torch.autograd.grad(loss, hidden)
    assert g.device == hidden.device and torch.isfinite(g).all()
