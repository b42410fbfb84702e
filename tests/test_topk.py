"""Property tests for bagua_lite.kernels.topk: exact top-k by magnitude, ties to the lower index.

The reference is a stable argsort of -|x| (float64, so every supported dtype converts exactly): its
first k entries are the selection; the kernel must return exactly that set, in ascending index order,
with values bit-identical to x[indices].
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bagua_lite
from bagua_lite import kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}
# Smallest positive subnormal of each dtype.
TINY = {dt: torch.finfo(dt).smallest_normal * torch.finfo(dt).eps for dt in DTYPES}

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_indices(x: torch.Tensor, k: int) -> np.ndarray:
    mag = x.reshape(-1).double().abs().numpy()
    order = np.argsort(-mag, kind="stable")  # ties keep ascending index
    return np.sort(order[:k])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.dtype])


def check_topk(x: torch.Tensor, k: int):
    values, indices = kernels.topk(x, k)
    assert indices.dtype == torch.int32, indices.dtype
    assert values.dtype == x.dtype, values.dtype
    assert values.shape == (k,) and indices.shape == (k,), (values.shape, indices.shape)
    idx = indices.long()
    if k > 1:
        assert bool((idx[1:] > idx[:-1]).all()), "indices must be strictly ascending"
    ref = reference_indices(x, k)
    assert np.array_equal(idx.numpy(), ref), (
        f"selection differs from the reference: first mismatch at output position "
        f"{int(np.argmax(idx.numpy() != ref)) if k else -1}")
    flat = x.reshape(-1)
    assert torch.equal(bits(values), bits(flat[idx])), "values must be bit-identical to x[indices]"
    # torch.topk picks the same magnitudes (as a multiset; it may break ties differently).
    if k > 0:
        tv = torch.topk(flat.abs(), k).values
        assert torch.equal(values.abs().sort().values, tv.sort().values)
    # topk_out into larger preallocated buffers writes the same first k entries and nothing else.
    vbuf = torch.full((k + 2,), 3.0, dtype=x.dtype)
    ibuf = torch.full((k + 2,), -7, dtype=torch.int32)
    kernels.topk_out(x, k, vbuf, ibuf)
    assert torch.equal(ibuf[:k], indices) and torch.equal(bits(vbuf[:k]), bits(values))
    assert torch.equal(ibuf[k:], torch.full((2,), -7, dtype=torch.int32))
    assert torch.equal(vbuf[k:].double(), torch.full((2,), 3.0, dtype=torch.float64))
    return values, indices


# ------------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------------

def element_strategy(dtype):
    width = {torch.float16: 16, torch.float32: 32, torch.bfloat16: 32, torch.float64: 64}[dtype]
    return st.floats(allow_nan=False, allow_infinity=True, allow_subnormal=True, width=width)


@st.composite
def small_arrays(draw):
    """Arbitrary small tensors element by element (hypothesis explores subnormals, +-0, +-inf, ...)."""
    dtype = draw(st.sampled_from(DTYPES))
    values = draw(st.lists(element_strategy(dtype), min_size=0, max_size=300))
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    k = draw(st.integers(0, x.numel()))
    return x, k


def make_structured(kind, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "few-distinct":  # heavy ties at the threshold
        x = torch.randint(-3, 4, (n,), generator=g).double()
    elif kind == "all-equal":
        x = torch.full((n,), -2.5, dtype=torch.float64) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    elif kind == "denormals":  # subnormals of the target dtype, zeros of both signs, a few infs
        x = torch.randint(-4, 5, (n,), generator=g).double() * TINY[dtype]
        x[torch.randint(0, n, (3,), generator=g)] = float("inf")
        x[torch.randint(0, n, (2,), generator=g)] = float("-inf")
    elif kind == "mostly-zero":
        x = torch.randn(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) < 0.01)
    elif kind == "sorted":
        x = torch.randn(n, generator=g, dtype=torch.float64).abs().sort().values
    elif kind == "clustered":  # all the large values in one contiguous block the sample mostly misses
        x = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
        start = int(torch.randint(0, max(1, n - n // 50), (1,), generator=g))
        x[start:start + n // 50] += 5.0
    else:
        raise ValueError(kind)
    return x.to(dtype).contiguous()


KINDS = ["randn", "few-distinct", "all-equal", "denormals", "mostly-zero", "sorted", "clustered"]


@st.composite
def structured_arrays(draw):
    """Larger tensors (up to 300k elements: fast path and fallback) with adversarial structure."""
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.sampled_from([1, 100, 4097, 70_000, 300_001]))
    k = draw(st.one_of(st.integers(0, n), st.integers(0, max(0, n // 100)), st.sampled_from([0, 1, n])))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    return make_structured(kind, n, dtype, seed), k


# ------------------------------------------------------------------------------------------------------
# Properties
# ------------------------------------------------------------------------------------------------------

@SETTINGS
@given(small_arrays())
def test_small_arbitrary(case):
    check_topk(*case)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structured_arrays())
def test_structured(case):
    check_topk(*case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 1000, 30_000, 131_072, 131_073, 500_000])
def test_large_randn(dtype, k):
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(k)).to(dtype)
    check_topk(x, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multidimensional_input_is_read_flat(dtype):
    x = torch.randn(64, 33, 7).to(dtype)
    values, indices = check_topk(x, 500)
    assert torch.equal(bits(values), bits(x.reshape(-1)[indices.long()]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_lower_index(dtype):
    x = torch.tensor([1.0, -2.0, 2.0, -2.0, 0.5, 2.0], dtype=dtype)
    values, indices = kernels.topk(x, 2)
    assert indices.tolist() == [1, 2]
    assert values.double().tolist() == [-2.0, 2.0]
    x = torch.full((200_000,), 7.0, dtype=dtype)
    assert kernels.topk(x, 1000)[1].tolist() == list(range(1000))


@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zero_and_infinities(dtype):
    x = torch.tensor([-0.0, 0.0, float("-inf"), 1.0, float("inf"), -0.0], dtype=dtype)
    values, indices = kernels.topk(x, 3)
    assert indices.tolist() == [2, 3, 4]
    assert values.double().tolist() == [float("-inf"), 1.0, float("inf")]
    values, indices = kernels.topk(x, 5)
    assert indices.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(bits(values), bits(x[:5]))  # -0.0 keeps its sign bit


def test_empty_and_k_zero():
    v, i = kernels.topk(torch.empty(0), 0)
    assert v.shape == (0,) and i.shape == (0,) and i.dtype == torch.int32
    v, i = kernels.topk(torch.randn(1000), 0)
    assert v.shape == (0,) and i.shape == (0,)


def test_result_independent_of_thread_count():
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    x[::97] = 1.25  # ties across the part boundaries
    expected = kernels.topk(x, 20_000)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = kernels.topk(x, 20_000)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# ------------------------------------------------------------------------------------------------------
# Rejections
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,at", [(1, 1, 0), (10, 0, 3), (10, 10, 9), (10, 4, 5), (1 << 20, 1000, 54321),
                                    (1 << 20, 400_000, 7)])
def test_nan_is_rejected(dtype, n, k, at):
    x = torch.randn(n).to(dtype)
    x[at] = float("nan")
    with pytest.raises(RuntimeError, match=f"NaN at index {at}"):
        kernels.topk(x, k)
    with pytest.raises(RuntimeError, match="NaN"):
        kernels.topk_out(x, k, torch.empty(k, dtype=dtype), torch.empty(k, dtype=torch.int32))


@SETTINGS
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 4999), min_size=1, max_size=5), st.integers(0, 5000))
def test_nan_anywhere_is_rejected_naming_the_first(dtype, positions, k):
    x = torch.randn(5000).to(dtype)
    x[torch.tensor(positions)] = float("nan")
    with pytest.raises(RuntimeError, match=f"NaN at index {min(positions)}"):
        kernels.topk(x, k)


def test_k_out_of_range():
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match=r"0 <= k <= numel = 100, got k = 101"):
        kernels.topk(x, 101)
    with pytest.raises(RuntimeError, match=r"0 <= k <= numel = 100, got k = -1"):
        kernels.topk(x, -1)


def test_non_contiguous_rejected():
    x = torch.randn(10, 20).t()
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.topk(x, 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.topk(torch.randn(100)[::2], 3)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_non_floating_rejected(dtype):
    x = torch.ones(10, dtype=dtype)
    with pytest.raises(RuntimeError, match="must be float32, float16, bfloat16 or float64"):
        kernels.topk(x, 3)


def test_out_buffers_validated():
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="at least k = 10"):
        kernels.topk_out(x, 10, torch.empty(5), torch.empty(10, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="indices.*Int"):
        kernels.topk_out(x, 10, torch.empty(10), torch.empty(10, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="values.*Float"):
        kernels.topk_out(x, 10, torch.empty(10, dtype=torch.float64), torch.empty(10, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------------
# Block maxima: topk_out(..., block_max) reads only the blocks that can hold the top k, and is exact
# ------------------------------------------------------------------------------------------------------

def block_bounds(x: torch.Tensor) -> torch.Tensor:
    """The exact bound of every 64-element block: the largest magnitude key (float32 bits, sign cleared)."""
    keys = x.reshape(-1).view(torch.int32) & 0x7FFFFFFF
    pad = torch.zeros((keys.numel() + 63) // 64 * 64, dtype=torch.int32)
    pad[:keys.numel()] = keys
    return pad.view(-1, 64).amax(1)


def _bounded(x, k, bounds):
    v, i = torch.full((k + 1,), 3.0), torch.full((k + 1,), -7, dtype=torch.int32)
    kernels.topk_out(x, k, v, i, bounds)
    path = bagua_lite._C._topk_last_path()
    assert int(i[k]) == -7, "wrote past k"
    return v[:k], i[:k], path


@pytest.mark.parametrize("data", ["heavy_tailed", "ties", "mostly_zero", "infinities"])
@pytest.mark.parametrize("n,k", [(64 * 1000, 1), (64 * 1000 + 17, 250), (1 << 20, 1000), (1 << 20, 4096)])
def test_block_max_selection_is_exact(data, n, k):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    if data == "ties":  # many equal magnitudes, some of them at the k-th place
        x[torch.randint(0, n, (3 * k,), generator=g)] = 2.5
        x[torch.randint(0, n, (3 * k,), generator=g)] = -2.5
    elif data == "mostly_zero":  # fewer non-zero blocks than k for small k ratios: the plain paths decide
        x[torch.rand(n, generator=g) < 0.995] = 0.0
    elif data == "infinities":
        x[torch.randint(0, n, (5,), generator=g)] = float("inf")
        x[7] = float("-inf")
    ref = reference_indices(x, k)
    exact = block_bounds(x)
    # loose bounds (a stale slot, a writer that overestimated) cost speed, never exactness
    loose = exact + torch.randint(0, 1 << 20, exact.shape, generator=g, dtype=torch.int32)
    loose[torch.randint(0, exact.numel(), (k,), generator=g)] = 0x7FFFFFFF
    for bounds in (exact, loose):
        v, i, path = _bounded(x, k, bounds)
        assert np.array_equal(i.long().numpy(), ref), (data, n, k)
        assert torch.equal(bits(v), bits(x[i.long()]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the path is serial: with more threads it yields to the plain pass sooner
    try:
        v, i, path = _bounded(x, k, exact)
    finally:
        torch.set_num_threads(threads)
    if data != "mostly_zero":
        assert path == 5, f"exact bounds should take the block-maxima path, took {path}"
    wv, wi = kernels.topk(x, k)  # and it is what the plain selection returns
    assert torch.equal(i, wi) and torch.equal(bits(v), bits(wv))


def test_block_max_too_many_blocks_uses_plain_path():
    x = torch.randn(64 * 100)
    v, i, path = _bounded(x, 50, block_bounds(x))  # k > blocks / 4: the filter pass streams faster
    assert path != 5 and np.array_equal(i.long().numpy(), reference_indices(x, 50))


def test_block_max_all_equal_uses_plain_path():
    x = torch.ones(1 << 20)  # every block's bound is the k-th largest: reading them all is the plain pass
    v, i, path = _bounded(x, 1000, block_bounds(x))
    assert path != 5 and torch.equal(i, torch.arange(1000, dtype=torch.int32)) and bool((v == 1).all())


def test_block_max_nan_is_rejected():
    x = torch.randn(1 << 18)
    x[123_456] = float("nan")
    bounds = block_bounds(x)  # a NaN's key is above every finite one: its block is read
    with pytest.raises(RuntimeError, match=r"NaN at index 123456"):
        _bounded(x, 100, bounds)


def test_block_max_bad_arguments_named():
    x = torch.randn(1000)
    v, i = torch.empty(10), torch.empty(10, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"block_max must be .* ceil\(numel / 64\) = 16 slots, got Long"):
        kernels.topk_out(x, 10, v, i, torch.zeros(16, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"16 slots, got Int .* with 15"):
        kernels.topk_out(x, 10, v, i, torch.zeros(15, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"block_max is for float32 .* got x of Double"):
        kernels.topk_out(x.double(), 10, v.double(), i, torch.zeros(16, dtype=torch.int32))
