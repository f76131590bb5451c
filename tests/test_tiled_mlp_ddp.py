"""A real DistributedDataParallel run: 2 processes on CPU, gloo backend; on a machine with two
GPUs also 2 processes over NCCL, one GPU each (there the fused path runs its Triton kernels).

The same model (a linear layer, then an MLP) runs untiled, tiled through the fused SwiGLU
path, and tiled through the generic path (a plain MLP module), each wrapped in DDP, for two
micro-batches: the first under ``no_sync()``, the second synchronized. Checks:

* no DDP error (each parameter is marked ready once per backward), and the averaged
  gradients are the same on both ranks (bitwise) and equal the untiled model's;
* they equal the mean over ranks of *both* micro-batches' local gradients (computed without
  DDP): the no_sync micro-batch's gradients were kept;
* a negative control, the usual tiling (per-shard ``backward`` through the real parameters,
  as peers do), does hit DDP's "marked ready only once" error, so the test can fail.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import SEED
from helpers import run_gloo_ranks

WORLD = 2
H, I, B, T, SHARDS = 16, 40, 2, 24, 3


class PlainMLP(nn.Module):
    """A user's own MLP module: the generic tiled path."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I)
        self.up_proj = nn.Linear(H, I)
        self.down_proj = nn.Linear(I, H)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PerShardBackward(torch.autograd.Function):
    """The common tiling of peers: backward runs ``autograd.backward`` per shard through the
    module's real parameters, so each parameter's hooks fire once per shard."""

    @staticmethod
    def forward(ctx, x, mlp):
        ctx.mlp = mlp
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([mlp(s) for s in x.chunk(SHARDS, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dxs = []
        for xs, dys in zip(x.chunk(SHARDS, dim=-2), dy.chunk(SHARDS, dim=-2)):
            xs = xs.detach().requires_grad_()
            with torch.enable_grad():
                torch.autograd.backward(ctx.mlp(xs), dys)
            dxs.append(xs.grad)
        return torch.cat(dxs, dim=-2), None


class Model(nn.Module):
    def __init__(self, kind):
        super().__init__()
        import logitless.torch as lt
        torch.manual_seed(SEED + 1234)  # the same weights in every process and for every kind
        self.kind = kind
        self.inp = nn.Linear(H, H)
        self.mlp = PlainMLP() if kind in ("generic", "per-shard") else lt.SwiGLUMLP(H, I, bias=True)

    def forward(self, x):
        import logitless.torch as lt
        h = self.inp(x)
        if self.kind == "untiled":
            return self.mlp(h)
        if self.kind == "per-shard":
            return PerShardBackward.apply(h, self.mlp)
        return lt.tiled_mlp(self.mlp, h, num_shards=SHARDS)


def _batches(rank, dev="cpu"):
    g = torch.Generator().manual_seed(SEED + 100 + rank)  # different data on each rank
    return [torch.randn(B, T, H, generator=g).to(dev) for _ in range(2)]


def _loss(model, x):
    return model(x).square().mean()


def _worker(rank, world, cuda=False):
    results = {}
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    batches = _batches(rank, dev)
    for kind in ("untiled", "fused", "generic", "per-shard"):
        # local gradients of both micro-batches, no DDP: the expected sums
        local = Model(kind if kind != "per-shard" else "generic").to(dev)
        for x in batches:
            _loss(local, x).backward()
        expected = {}
        for n, p in local.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            expected[n] = (g / world).cpu()
        model = DDP(Model(kind).to(dev), device_ids=[rank] if cuda else None)
        try:
            with model.no_sync():
                _loss(model, batches[0]).backward()
            _loss(model, batches[1]).backward()
            grads = {n[len("module."):]: p.grad.cpu() for n, p in model.named_parameters()}
            results[kind] = dict(grads=grads, expected=expected, error=None)
        except RuntimeError as e:
            results[kind] = dict(grads=None, expected=expected, error=str(e))
        # realign the ranks after a failure mid-backward (a reducer may be left waiting)
        dist.barrier()
    return results


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.fixture(scope="module", params=["gloo", pytest.param("nccl", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs")])])
def ddp_results(request, tmp_path_factory):
    # gloo workers run the SwiGLU's torch formula, not the Triton interpreter: this test is
    # about autograd and DDP, and the interpreter is slow; nccl ones the GPU's Triton kernels
    nccl = request.param == "nccl"
    return run_gloo_ranks(_worker, WORLD, tmp_path_factory.mktemp("ddp"), nccl,
                          backend=request.param)


@pytest.mark.parametrize("kind", ["fused", "generic"])
def test_ddp_tiled_equals_untiled_and_keeps_no_sync_grads(ddp_results, kind):
    for rank, res in enumerate(ddp_results):
        tiled, untiled = res[kind], res["untiled"]
        assert tiled["error"] is None, f"rank {rank}: DDP error: {tiled['error']}"
        assert untiled["error"] is None, untiled["error"]
        for n, g in tiled["grads"].items():
            # both micro-batches' gradients, averaged over the ranks (fp32: equal up to the
            # summation order, norm-wise)
            assert _rel_err(g, tiled["expected"][n]) <= 1e-5, (rank, n)
            assert _rel_err(g, untiled["grads"][n]) <= 1e-5, (rank, n, "vs untiled")
            # the all-reduced gradient is the same on every rank
            torch.testing.assert_close(g, ddp_results[0][kind]["grads"][n], rtol=0, atol=0)


def test_negative_control_per_shard_backward_breaks_ddp(ddp_results):
    for res in ddp_results:
        err = res["per-shard"]["error"]
        assert err is not None and "only once" in err, err
