"""The token-chunk plan (``logitless.specs.tiling``): budget arithmetic, rounding, the
``chunk_size`` override, coverage of ``[0, n)``, and argument errors."""
import numpy as np
import pytest

from harness import SEED
from logitless.specs.tiling import (DEFAULT_BUDGET_BYTES, ChunkPlan, balanced, ceil_div,
                                    next_power_of_2, plan_token_chunks)


def assert_partition(plan: ChunkPlan):
    """bounds() tile [0, n) in order, without gap or overlap, every chunk but the last full."""
    b = plan.bounds()
    assert len(b) == plan.num_chunks >= 1
    assert b[0][0] == 0 and b[-1][1] == plan.n
    for (s0, e0), (s1, _) in zip(b, b[1:]):
        assert e0 == s1 and e0 - s0 == plan.chunk
    for s, e in b:
        assert 0 <= s <= e <= plan.n and (e > s or plan.n == 0)
    assert sum(e - s for s, e in b) == plan.n


@pytest.mark.parametrize("n, v, bpe, budget, want", [
    (10**6, 1000, 8, 1 << 20, 128),          # 1048576 // 8000 = 131 -> rounded down to 128
    (10**6, 1000, 4, 1 << 20, 256),          # 262 -> 256
    (10**6, 1000, 4, 1000 * 4 * 1000, 896),  # exactly 1000 rows fit -> 896
    (10**6, 1000, 4, 1000 * 4 * 100, 100),   # below one multiple: no rounding
    (10**6, 1000, 4, 1000 * 4 * 100 - 1, 99),
    (10**6, 1000, 4, 1000 * 4 * 5, 16),      # tiny budget: min_chunk
    (10**6, 1000, 4, 1, 16),
    (50, 1000, 4, 1 << 30, 50),              # never more than n
    (1, 128256, 8, 1 << 30, 1),
    (10**6, 128256, 2, None, 4096),          # the default budget at the Llama-3 vocabulary
    (10**6, 128256, 8, None, 1024),          # fp32 logits + fp32 gradient
])
def test_budget_arithmetic(n, v, bpe, budget, want):
    plan = plan_token_chunks(n, v, bytes_per_element=bpe, budget_bytes=budget)
    assert plan.chunk == want and plan.n == n
    assert_partition(plan)


def test_default_budget_is_used_when_none():
    a = plan_token_chunks(10**7, 5000, bytes_per_element=4)
    b = plan_token_chunks(10**7, 5000, bytes_per_element=4, budget_bytes=DEFAULT_BUDGET_BYTES)
    assert a == b


def test_budget_plan_properties_random():
    """On random problems: the chunk fits the budget and is the largest multiple of
    `multiple` (of 1 when not even one multiple fits) that does, or else it is min_chunk."""
    rng = np.random.default_rng(SEED)
    for i in range(2000):
        n = int(rng.integers(0, 5000)) if i % 2 else int(rng.integers(0, 10**6))
        v = int(rng.integers(1, 300000))
        bpe = int(rng.choice([1, 2, 4, 8]))
        multiple = int(rng.choice([1, 8, 64, 128]))
        min_chunk = int(rng.choice([1, 16, 32]))
        if i % 2:  # budgets of a few rows to a few hundred: the rounding and clamping region
            budget = v * bpe * int(rng.integers(0, 300)) + int(rng.integers(1, v * bpe + 1))
        else:
            budget = int(rng.integers(1, 1 << 34))
        p = plan_token_chunks(n, v, bytes_per_element=bpe, budget_bytes=budget,
                              multiple=multiple, min_chunk=min_chunk)
        c = p.chunk
        fits = lambda rows: rows * v * bpe <= budget
        assert p.n == n and 1 <= c <= max(n, 1) and c >= min(min_chunk, max(n, 1))
        if c < n:                                   # not clamped by the problem size
            if fits(c):
                step = multiple if fits(multiple) else 1
                assert c % step == 0 and not fits(c + step), (budget, v, bpe, multiple, c)
            else:
                assert c == min_chunk, (budget, v, bpe, c)
        assert_partition(p)


@pytest.mark.parametrize("n, chunk_size, want", [
    (1000, 7, 7), (1000, 1, 1), (1000, 1000, 1000), (1000, 5000, 1000), (5, 3, 3),
    (0, 64, 1), (1, 64, 1),
])
def test_chunk_size_overrides_budget(n, chunk_size, want):
    # a budget that alone would give another chunk: the explicit chunk_size wins
    p = plan_token_chunks(n, 1000, bytes_per_element=4, budget_bytes=1, chunk_size=chunk_size)
    assert p.chunk == want
    assert_partition(p)


@pytest.mark.parametrize("n", [0, 1, 2, 15, 16, 17, 127, 128, 129, 1000, 4097])
@pytest.mark.parametrize("chunk", [1, 3, 16, 128, None])
def test_bounds_cover_exactly(n, chunk):
    p = plan_token_chunks(n, 97, bytes_per_element=4, budget_bytes=97 * 4 * 50, chunk_size=chunk)
    assert_partition(p)
    assert p.num_chunks == max(1, ceil_div(n, p.chunk))
    covered = np.zeros(n, int)
    for s, e in p.bounds():
        covered[s:e] += 1
    assert np.all(covered == 1)


def test_small_n():
    p0 = plan_token_chunks(0, 10, bytes_per_element=4)
    assert p0.n == 0 and p0.chunk >= 1 and p0.num_chunks == 1
    assert sum(e - s for s, e in p0.bounds()) == 0
    p1 = plan_token_chunks(1, 10, bytes_per_element=4)
    assert p1.chunk == 1 and p1.bounds() == [(0, 1)]


@pytest.mark.parametrize("kwargs, name", [
    (dict(n=-1), "n"),
    (dict(n=2.0), "n"),
    (dict(n=None), "n"),
    (dict(v=0), "v"),
    (dict(v=-5), "v"),
    (dict(v=10.0), "v"),
    (dict(bytes_per_element=0), "bytes_per_element"),
    (dict(bytes_per_element=2.0), "bytes_per_element"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=-8), "chunk_size"),
    (dict(chunk_size=64.0), "chunk_size"),
    (dict(chunk_size=True), "chunk_size"),
    (dict(budget_bytes=0), "budget"),
    (dict(budget_bytes=-1), "budget"),
    (dict(budget_bytes=1.5e9), "budget"),
    (dict(budget_bytes=True), "budget"),
])
def test_bad_arguments_raise(kwargs, name):
    args = dict(n=100, v=10, bytes_per_element=4)
    args.update(kwargs)
    n, v = args.pop("n"), args.pop("v")
    with pytest.raises(ValueError, match=name):
        plan_token_chunks(n, v, **args)


@pytest.mark.parametrize("n, chunk, want", [
    (8192, 1792, 1640),  # 5 chunks either way: 4 × 1792 + 1024 -> 5 × 1640 (8200, 8 padded)
    (8192, 1024, 1024),  # already equal
    (16384, 3584, 3280),
    (37, 24, 24),        # 2 × 19 -> rounded up to 24
    (100, 200, 200),     # one chunk: as is
    (0, 16, 16),
    (37, 20, 20),        # the equal size (24) would exceed the chunk: as is
])
def test_balanced_keeps_the_count_and_evens_the_sizes(n, chunk, want):
    plan = ChunkPlan(n=n, chunk=chunk)
    out = balanced(plan)
    assert out.chunk == want and out.num_chunks == plan.num_chunks
    assert out.chunk <= plan.chunk and out.chunk % 8 == 0 or out == plan
    assert out.num_chunks * out.chunk - n < 8 * out.num_chunks or out == plan


def test_ceil_div():
    for a in range(0, 40):
        for b in range(1, 9):
            assert ceil_div(a, b) == -(-a // b) == int(np.ceil(a / b))
    assert ceil_div(2**62 + 1, 2**31) == 2**31 + 1


def test_next_power_of_2():
    assert [next_power_of_2(x) for x in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]
    for k in range(1, 63):
        for x in (2**k - 1, 2**k, 2**k + 1):
            p = next_power_of_2(x)
            assert p >= x and p & (p - 1) == 0 and p < 2 * x, (x, p)
