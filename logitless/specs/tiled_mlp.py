r"""Tiled MLP: the one definition every backend implements (NumPy only).

A position-wise MLP ``y_i = f(θ, x_i)`` (each token's output depends on that token alone)
applied to ``x`` of shape ``[..., T, H]`` (usually ``[B, T, H]`` or ``[T, H]``). Its
intermediates (``[T, I]`` per projection, ``I`` ≈ 3.5·H for Llama) are what long-context
training runs out of memory on. Tiling trades one extra forward for them:

* **Shards.** The leading dims and the sequence dim are flattened into ``N = B·T`` tokens (a
  free view of a contiguous input). With ``S`` shards each holds ``ceil(N / S)`` consecutive
  tokens and the last one the remainder (fewer than ``S`` shards when ``N`` is small; see
  :func:`plan_shards`). The default ``S`` is ``ceil(T / H)`` (``T = x.shape[-2]``), so a
  shard has about ``B·H`` tokens and its ``[tokens, I]`` intermediates are the size of a
  few ``[H, I]`` weights. The MLP sees each shard with the input's rank: ``[1, …, 1, n, H]``.
* **Forward.** ``y[shard] = f(θ, x[shard])`` for every shard, written into one output;
  nothing of a shard survives it (no activations are saved).
* **Backward.** Given ``dy``, for every shard: recompute ``f(θ, x[shard])`` and take its
  vector-Jacobian product with ``dy[shard]``: ``dx[shard] = ∂f/∂x ᵀ·dy[shard]`` and the
  shard's parameter gradient ``dθ_s = ∂f/∂θ ᵀ·dy[shard]``. The parameter gradient is
  ``dθ = Σ_s dθ_s`` (accumulated in each parameter's dtype by default, in float32 with
  ``grad_accum_dtype=float32``) and is handed to the framework
  **once**: gradient hooks fire once per parameter (data-parallel wrappers reduce it once),
  and gradients already accumulated by earlier micro-batches are kept.

The ready-made MLP is Llama's SwiGLU (``nn.Linear`` weight layout ``[out, in]``)::

    g = x·W_gᵀ (+ b_g)      u = x·W_uᵀ (+ b_u)      h = silu(g)·u      y = h·W_dᵀ (+ b_d)

    silu(g) = g·σ(g);  σ' = σ(1 − σ)
    dh = dy·W_d                      dW_d = Σ_tokens dyᵀ·h           db_d = Σ dy
    dg = dh·u·σ(g)·(1 + g·(1 − σ(g)))                               (= dh·u·silu'(g))
    du = dh·silu(g)
    dx = dg·W_g + du·W_u             dW_g = Σ dgᵀ·x   dW_u = Σ duᵀ·x
                                     db_g = Σ dg      db_u = Σ du

Its backward per shard needs ``g``, ``u`` and ``h`` but never the shard's ``y``: a fused
backend recomputes two of the three GEMMs (``2 + 3 + 6 = 11`` GEMMs in all instead of the
untiled 9), a generic one all three (12). The fused ``swiglu`` computes ``h`` (and ``dg``,
``du``) in fp32 from the half-precision ``g``, ``u`` (and ``dh``) and rounds once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """``n`` tokens in shards of ``shard`` consecutive tokens, the last one possibly short."""

    n: int
    shard: int

    @property
    def num_shards(self) -> int:
        return -(-self.n // self.shard)

    @property
    def full_shards(self) -> int:
        """Shards of exactly ``shard`` tokens."""
        return self.n // self.shard

    @property
    def tail(self) -> int:
        """Tokens of the short last shard (0 when every shard is full)."""
        return self.n % self.shard

    def bounds(self):
        """``(start, stop)`` of every shard."""
        return [(s, min(s + self.shard, self.n)) for s in range(0, self.n, self.shard)]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_input_shape(shape: Sequence[int], name: str = "x") -> Tuple[int, int, int]:
    """``(N tokens, T sequence length, H hidden)`` of an ``[..., T, H]`` input."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"{name} must have shape [..., T, H] (e.g. [B, T, H] or [T, H]), "
                         f"got {list(shape)}")
    if shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty hidden dim, got shape {list(shape)}")
    return math.prod(shape[:-1]), shape[-2], shape[-1]


def default_num_shards(seq_len: int, hidden: int) -> int:
    """``ceil(T / H)``, at least 1: about ``H`` tokens of the sequence per shard."""
    return max(1, -(-int(seq_len) // int(hidden)))


def plan_shards(shape: Sequence[int], num_shards: Optional[int] = None) -> ShardPlan:
    """The shard plan for an input of ``shape`` ``[..., T, H]``: ``ceil(N / S)`` tokens per
    shard, ``S = num_shards`` or :func:`default_num_shards`. ``S`` larger than ``N`` is
    clamped to ``N`` (a shard holds at least one token)."""
    n, t, h = check_input_shape(shape)
    s = default_num_shards(t, h) if num_shards is None else _positive_int("num_shards", num_shards)
    s = max(1, min(s, n))
    return ShardPlan(n=n, shard=max(1, -(-n // s)))


def shard_shape(shape: Sequence[int], tokens: int) -> Tuple[int, ...]:
    """Shape in which the MLP sees a shard of ``tokens`` tokens: the input's rank kept,
    ``[1, …, 1, tokens, H]``."""
    return (1,) * (len(shape) - 2) + (int(tokens), int(shape[-1]))


# ----------------------------------------------------------------------------- SwiGLU math
def sigmoid(g: np.ndarray) -> np.ndarray:
    """σ(g) without overflow warnings for large |g|."""
    e = np.exp(-np.abs(g))
    return np.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``h = silu(gate)·up`` (float64)."""
    g = np.asarray(gate, np.float64)
    return g * sigmoid(g) * np.asarray(up, np.float64)


def swiglu_grad(dh: np.ndarray, gate: np.ndarray, up: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(d gate, d up)`` of ``h = silu(gate)·up`` for the upstream gradient ``dh`` (float64)."""
    g, u, dh = (np.asarray(a, np.float64) for a in (gate, up, dh))
    s = sigmoid(g)
    return dh * u * s * (1.0 + g * (1.0 - s)), dh * g * s


SWIGLU_PARAMS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def swiglu_mlp_reference(x, params: Dict[str, np.ndarray], dy=None,
                         num_shards: Optional[int] = None) -> Dict[str, np.ndarray]:
    """The SwiGLU MLP forward and backward in float64, run as the tiled algorithm above.

    ``params``: ``w_gate (I, H)``, ``w_up (I, H)``, ``w_down (H_out, I)`` and optionally
    ``b_gate``, ``b_up`` (I,), ``b_down`` (H_out,). Returns ``y`` (shaped like ``x`` with
    ``H_out`` last) and, with ``dy``, ``dx`` and a gradient per given parameter (same names
    prefixed ``d``). In float64 the shard count changes the result only by rounding.
    """
    x = np.asarray(x, np.float64)
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if v is not None}
    unknown = set(p) - set(SWIGLU_PARAMS)
    if unknown:
        raise ValueError(f"unknown SwiGLU parameters {sorted(unknown)}; expected {SWIGLU_PARAMS}")
    plan = plan_shards(x.shape, num_shards)
    h_out = p["w_down"].shape[0]
    x2 = x.reshape(plan.n, x.shape[-1])
    y2 = np.empty((plan.n, h_out))
    grads = None
    if dy is not None:
        dy2 = np.asarray(dy, np.float64).reshape(plan.n, h_out)
        dx2 = np.empty_like(x2)
        grads = {"d" + k: np.zeros_like(v) for k, v in p.items()}
    for s, e in plan.bounds():
        xs = x2[s:e]
        g = xs @ p["w_gate"].T + p.get("b_gate", 0.0)
        u = xs @ p["w_up"].T + p.get("b_up", 0.0)
        h = swiglu(g, u)
        y2[s:e] = h @ p["w_down"].T + p.get("b_down", 0.0)
        if dy is None:
            continue
        dys = dy2[s:e]
        dg, du = swiglu_grad(dys @ p["w_down"], g, u)
        dx2[s:e] = dg @ p["w_gate"] + du @ p["w_up"]
        grads["dw_down"] += dys.T @ h
        grads["dw_gate"] += dg.T @ xs
        grads["dw_up"] += du.T @ xs
        for name, d in (("b_gate", dg), ("b_up", du), ("b_down", dys)):
            if name in p:
                grads["d" + name] += d.sum(0)
    out = {"y": y2.reshape(x.shape[:-1] + (h_out,))}
    if dy is not None:
        out["dx"] = dx2.reshape(x.shape)
        out.update(grads)
    return out
