"""Single-process tests of the compute kernels (bagua_lite.kernels), except topk (see test_topk.py).

References are plain numpy/torch; bit-exact where the kernel documents a fixed order of operations.
"""
import math
import numpy as np
import pytest
import torch

import bagua_lite
from bagua_lite import kernels as K
from test_topk import block_bounds  # the exact block maxima, the reference for the writers too

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _rand(n, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# compress / decompress


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 100_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp16_roundtrip_and_wire(n, dtype):
    x = _rand(n, 1 + n, dtype, scale=3.0)
    w = K.compress(x, "fp16")
    assert w.dtype == torch.uint8 and w.dim() == 1
    assert w.numel() == 2 * n == K.wire_bytes("fp16", n)
    # The wire is exactly IEEE half, little endian.
    assert torch.equal(w.view(torch.float16), x.to(torch.float16))
    y = K.decompress(w, "fp16", n, dtype)
    assert y.dtype == dtype and y.shape == (n,)
    assert torch.equal(y, x.to(torch.float16).to(dtype))
    if n:
        # Round to nearest half: relative error <= 2^-11 for normal values.
        assert torch.all((y - x).abs() <= x.abs() * 2.0 ** -11 + 2.0 ** -25)


def _minmax_ref(x):
    """numpy model of the minmax_uint8 wire format: [min f32][max f32][q uint8 * n]."""
    xf = x.to(torch.float32).numpy()
    if xf.size == 0:
        return np.float32(0), np.float32(0), np.zeros(0, np.uint8)
    lo, hi = np.float32(xf.min()), np.float32(xf.max())
    rng = np.float32(hi - lo)
    scale = np.float32(255.0) / rng if rng > 0 else np.float32(0)
    if rng > 0 and lo <= 0 <= hi:  # the grid is anchored at 0: zero is a level
        origin, zero = np.float32(0), np.rint(-lo * scale).astype(np.float32)
    else:
        origin, zero = lo, np.float32(0)
    q = np.rint(np.clip((xf - origin) * scale + zero, 0, 255)).astype(np.uint8)
    return lo, hi, q


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, 100_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_minmax_roundtrip_and_wire(n, dtype):
    x = _rand(n, 7 + n, dtype, scale=5.0) + 1.5
    w = K.compress(x, "minmax_uint8")
    assert w.dtype == torch.uint8 and w.numel() == 8 + n == K.wire_bytes("minmax_uint8", n)
    lo, hi, q = _minmax_ref(x)
    header = w[:8].view(torch.float32)
    assert header[0].item() == lo and header[1].item() == hi
    if n:
        # Quantization to the nearest level (a level off only where the float product lies on a .5 edge).
        assert np.abs(w[8:].numpy().astype(int) - q.astype(int)).max() <= 1
        assert (w[8:].numpy() == q).mean() > 0.999
    y = K.decompress(w, "minmax_uint8", n, dtype)
    assert y.dtype == dtype and y.shape == (n,)
    if n:
        step = (float(hi) - float(lo)) / 255
        err = (y.double() - x.double()).abs().max().item()
        tol = step / 2 + 1e-6 * max(abs(float(lo)), abs(float(hi)))
        if dtype == torch.float16:
            tol += 2.0 ** -10 * max(abs(float(lo)), abs(float(hi)))  # rounding of the decoded value to half
        assert err <= tol, (err, tol)
        if not float(lo) <= 0 <= float(hi):
            # Anchored at min: the extremes are exact (up to float rounding of the step sum).
            assert y.double().min().item() == pytest.approx(float(lo), abs=1e-6 * (1 + abs(float(lo))))
            assert y.double().max().item() == pytest.approx(float(hi), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("shift", [0.0, -0.3, 0.7])
def test_minmax_keeps_exact_zeros(shift):
    """A range containing 0 puts 0 on the grid: entries that are exactly 0 decode to exactly 0 (so a
    coordinate that never gets a gradient is never moved by quantization noise); other entries stay
    within half a step."""
    x = _rand(10_000, 3, torch.float32) + shift
    x[::7] = 0.0
    y = K.decompress(K.compress(x, "minmax_uint8"), "minmax_uint8", x.numel(), torch.float32)
    assert torch.equal(y[::7], torch.zeros_like(y[::7]))
    step = float(x.max() - x.min()) / 255
    assert float((y - x).abs().max()) <= step / 2 * 1.0001


@pytest.mark.parametrize("value", [0.0, -3.25, 1e6])
@pytest.mark.parametrize("compression", ["fp16", "minmax_uint8"])
def test_constant_tensor_is_exact(value, compression):
    x = torch.full((33,), value)
    y = K.decompress(K.compress(x, compression), compression, 33, torch.float32)
    expect = x.to(torch.float16).float() if compression == "fp16" else x
    assert torch.equal(y, expect)
    if compression == "minmax_uint8":
        assert torch.equal(K.compress(x, compression)[8:], torch.zeros(33, dtype=torch.uint8))


def test_minmax_decompress_is_deterministic_function_of_bytes():
    x = _rand(5000, 3)
    w = K.compress(x, "minmax_uint8")
    a = K.decompress(w, "minmax_uint8", 5000, torch.float32)
    b = K.decompress(w.clone(), "minmax_uint8", 5000, torch.float32)
    assert torch.equal(a, b)
    # Decoding formula in float32: (q - z) * step with z = rint(-lo * 255 / (hi - lo)) when lo <= 0 <= hi
    # (this data crosses 0), else lo + q * step.
    lo, hi = (np.float32(v) for v in w[:8].view(torch.float32).tolist())
    assert lo < 0 < hi
    step = np.float32((hi - lo) / np.float32(255))
    z = np.rint(-lo * (np.float32(255) / (hi - lo))).astype(np.float32)
    ref = np.float32(0) + (w[8:].numpy().astype(np.float32) - z) * step
    assert np.array_equal(a.numpy(), ref.astype(np.float32))
    shifted = x.abs() + 1.0  # all positive: the grid is anchored at min
    w = K.compress(shifted, "minmax_uint8")
    lo, hi = (np.float32(v) for v in w[:8].view(torch.float32).tolist())
    step = np.float32((hi - lo) / np.float32(255))
    ref = lo + w[8:].numpy().astype(np.float32) * step
    assert np.array_equal(K.decompress(w, "minmax_uint8", 5000, torch.float32).numpy(), ref.astype(np.float32))


def test_compress_bad_arguments():
    with pytest.raises(ValueError, match=r"unknown compression 'int4'.*'fp16', 'bf16', 'minmax_uint8', 'sign'"):
        K.compress(torch.ones(4), "int4")
    with pytest.raises(ValueError, match=r"unknown compression 'bogus'"):
        K.decompress(torch.zeros(8, dtype=torch.uint8), "bogus", 4, torch.float32)
    with pytest.raises(ValueError, match=r"unknown compression 'x'"):
        K.wire_bytes("x", 3)
    with pytest.raises(ValueError, match=r"`x` must be float32, float64, float16 or bfloat16, got Int"):
        K.compress(torch.ones(4, dtype=torch.int32), "fp16")
    with pytest.raises(ValueError, match=r"`x` must be contiguous"):
        K.compress(torch.ones(8)[::2], "minmax_uint8")
    with pytest.raises(ValueError, match=r"wire buffer has 7 bytes, expected 8"):
        K.decompress(torch.zeros(7, dtype=torch.uint8), "fp16", 4, torch.float32)
    with pytest.raises(ValueError, match=r"wire buffer has 11 bytes, expected 12"):
        K.decompress(torch.zeros(11, dtype=torch.uint8), "minmax_uint8", 4, torch.float32)
    with pytest.raises(ValueError, match=r"wire buffer must be uint8, got Float"):
        K.decompress(torch.zeros(2), "fp16", 1, torch.float32)
    with pytest.raises(ValueError, match=r"numel must be >= 0, got -1"):
        K.decompress(torch.zeros(0, dtype=torch.uint8), "fp16", -1, torch.float32)
    with pytest.raises(ValueError, match=r"dtype must be floating, got Int"):
        K.decompress(torch.zeros(8, dtype=torch.uint8), "fp16", 4, torch.int32)
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.ones(10)
        x[3] = bad
        with pytest.raises(ValueError, match=r"minmax_uint8 compress: input must be finite"):
            K.compress(x, "minmax_uint8")


# ---------------------------------------------------------------------------------------------------------
# sparse sets


def _np_normalize(v, i):
    """Sort by index (stable) and sum duplicates in input order, in the values' dtype."""
    v, i = np.asarray(v), np.asarray(i)
    order = np.argsort(i, kind="stable")
    out_v, out_i = [], []
    for j in order:
        if out_i and out_i[-1] == i[j]:
            out_v[-1] = (out_v[-1] + v[j]).astype(v.dtype)
        else:
            out_v.append(v[j].copy())
            out_i.append(i[j])
    return np.array(out_v, dtype=v.dtype), np.array(out_i, dtype=np.int32)


def _np_merge_topk(av, ai, bv, bi, k):
    """Union of two canonical sets (sum on equal indices), k largest |v|, ties by lower index, by index."""
    d = {}
    for v, i in zip(av, ai):
        d[int(i)] = v
    for v, i in zip(bv, bi):
        d[int(i)] = (d[int(i)] + v).astype(av.dtype) if int(i) in d else v
    items = sorted(d.items(), key=lambda kv: (-abs(float(kv[1])), kv[0]))[:k]
    items.sort()
    return (np.array([v for _, v in items], dtype=av.dtype).reshape(-1),
            np.array([i for i, _ in items], dtype=np.int32).reshape(-1))


def _int_valued(n, seed, lo=-6, hi=7, dtype=torch.float32):
    """Small integer-valued floats: many magnitude ties and exact sums."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def _canonical(n, universe, seed, dtype=torch.float32, int_valued=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(universe, generator=g)[:n].sort().values.to(torch.int32)
    val = _int_valued(n, seed + 1, dtype=dtype) if int_valued else _rand(n, seed + 1, dtype)
    return val, idx


@pytest.mark.parametrize("dtype", FLOATS)
def test_sparse_normalize(dtype):
    g = torch.Generator().manual_seed(5)
    for n in (0, 1, 2, 50, 1000):
        i = torch.randint(0, max(1, n // 3), (n,), generator=g, dtype=torch.int32)
        v = _rand(n, n, dtype)
        nv, ni = K.sparse_normalize(v, i)
        assert ni.dtype == torch.int32 and nv.dtype == dtype
        if dtype in (torch.float32, torch.float64):
            rv, ri = _np_normalize(v.numpy(), i.numpy())
            assert np.array_equal(ni.numpy(), ri)
            assert np.array_equal(nv.numpy(), rv)  # bit-exact: same summation order
        else:
            ref = torch.zeros(max(1, n), dtype=torch.float64).index_add_(0, i.long(), v.double())
            assert torch.equal(ni, torch.unique(i))
            assert torch.allclose(nv.double(), ref[ni.long()], rtol=2e-2, atol=2e-2)
        assert torch.all(ni[1:] > ni[:-1])
        # Inputs untouched; an already canonical set comes back as it is.
        nv2, ni2 = K.sparse_normalize(nv, ni)
        assert torch.equal(nv2, nv) and torch.equal(ni2, ni)


def test_sparse_normalize_sums_duplicates_in_input_order():
    # 1e8 + 1 - 1e8 in float32 depends on the order; stable order = input order.
    v = torch.tensor([1e8, 1.0, -1e8, 5.0], dtype=torch.float32)
    i = torch.tensor([3, 3, 3, 0], dtype=torch.int32)
    nv, ni = K.sparse_normalize(v, i)
    assert ni.tolist() == [0, 3]
    assert nv.tolist() == [5.0, float(np.float32(np.float32(1e8) + np.float32(1.0)) - np.float32(1e8))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("int_valued", [False, True])
def test_merge_topk_reference_and_symmetry(dtype, int_valued):
    for trial in range(40):
        na, nb = [(0, 0), (0, 5), (7, 0), (20, 20), (100, 37), (300, 300)][trial % 6]
        universe = [40, 500, 10_000][trial % 3]
        na, nb = min(na, universe), min(nb, universe)
        av, ai = _canonical(na, universe, 100 + trial, dtype, int_valued)
        bv, bi = _canonical(nb, universe, 200 + trial, dtype, int_valued)
        for k in (0, 1, 5, na + nb, na + nb + 3, max(1, (na + nb) // 2)):
            ov, oi = K.merge_topk(av, ai, bv, bi, k)
            rv, ri = _np_merge_topk(av.numpy(), ai.numpy(), bv.numpy(), bi.numpy(), k)
            assert oi.dtype == torch.int32 and ov.dtype == dtype
            assert np.array_equal(oi.numpy(), ri), (trial, k)
            assert np.array_equal(ov.numpy(), rv), (trial, k)
            sv, si = K.merge_topk(bv, bi, av, ai, k)
            assert torch.equal(si, oi)
            assert torch.equal(sv.view(torch.uint8),
                               ov.view(torch.uint8))  # bitwise, signed zeros included


def test_merge_topk_ties_go_to_lower_index():
    av = torch.tensor([1.0, -2.0, 2.0], dtype=torch.float32)
    ai = torch.tensor([1, 5, 9], dtype=torch.int32)
    bv = torch.tensor([-2.0, 2.0], dtype=torch.float32)
    bi = torch.tensor([3, 7], dtype=torch.int32)
    ov, oi = K.merge_topk(av, ai, bv, bi, 2)
    assert oi.tolist() == [3, 5] and ov.tolist() == [-2.0, -2.0]
    ov, oi = K.merge_topk(av, ai, bv, bi, 3)
    assert oi.tolist() == [3, 5, 7]
    # Sums on equal indices compete with their summed magnitude.
    ov, oi = K.merge_topk(torch.tensor([1.5]), torch.tensor([4], dtype=torch.int32),
                          torch.tensor([1.5, 2.5]), torch.tensor([4, 6], dtype=torch.int32), 1)
    assert oi.tolist() == [4] and ov.tolist() == [3.0]


def test_merge_topk_half_types():
    for dtype in (torch.float16, torch.bfloat16):
        av, ai = _canonical(60, 200, 1, dtype, int_valued=True)
        bv, bi = _canonical(60, 200, 2, dtype, int_valued=True)
        ov, oi = K.merge_topk(av, ai, bv, bi, 25)
        rv, ri = _np_merge_topk(av.float().numpy(), ai.numpy(), bv.float().numpy(), bi.numpy(), 25)
        assert np.array_equal(oi.numpy(), ri) and np.array_equal(ov.float().numpy(), rv)
        sv, si = K.merge_topk(bv, bi, av, ai, 25)
        assert torch.equal(si, oi) and torch.equal(sv, ov)


def test_merge_topk_bad_arguments():
    v, i = torch.ones(3), torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`ai` must be strictly ascending.*position 1 has 1 after 1"):
        K.merge_topk(v, torch.tensor([1, 1, 2], dtype=torch.int32), v, i, 2)
    with pytest.raises(ValueError, match=r"`bi` must be strictly ascending.*position 2 has 0 after 2"):
        K.merge_topk(v, i, v, torch.tensor([1, 2, 0], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"k must be >= 0, got -1"):
        K.merge_topk(v, i, v, i, -1)
    with pytest.raises(ValueError, match=r"value dtypes differ \(Float vs Double\)"):
        K.merge_topk(v, i, v.double(), i, 2)
    with pytest.raises(ValueError, match=r"`indices` must be int32, got Long"):
        K.merge_topk(v, i.long(), v, i, 2)
    with pytest.raises(ValueError, match=r"`values` has 3 elements but `indices` has 2"):
        K.merge_topk(v, i, v, i[:2], 2)
    with pytest.raises(ValueError, match=r"index -1 at position 0 is out of range"):
        K.merge_topk(v, torch.tensor([-1, 0, 1], dtype=torch.int32), v, i, 2)


@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.float64])
def test_scatter_add_in_order_with_duplicates(dense_dtype):
    g = torch.Generator().manual_seed(9)
    dense = _rand(100, 4, dense_dtype)
    idx = torch.randint(0, 100, (1000,), generator=g, dtype=torch.int32)
    val = _rand(1000, 5, dense_dtype)
    ref = dense.numpy().copy()
    np.add.at(ref, idx.numpy(), val.numpy())  # unbuffered, in order of j
    out = K.scatter_add_(dense, val, idx)
    assert out is dense
    assert np.array_equal(dense.numpy(), ref)
    # Empty update leaves dense alone; a float32 update into float64 converts each value.
    before = dense.clone()
    K.scatter_add_(dense, torch.zeros(0, dtype=dense_dtype), torch.zeros(0, dtype=torch.int32))
    assert torch.equal(dense, before)


def test_scatter_add_bad_arguments():
    d = torch.zeros(10)
    with pytest.raises(ValueError, match=r"index 10 at position 1 is out of range \[0, 10\)"):
        K.scatter_add_(d, torch.ones(2), torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"index -3 at position 0 is out of range \[0, 10\)"):
        K.scatter_add_(d, torch.ones(1), torch.tensor([-3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`indices` must be int32, got Long"):
        K.scatter_add_(d, torch.ones(1), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"`dense` must be contiguous"):
        K.scatter_add_(torch.zeros(20)[::2], torch.ones(1), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`values` has 2 elements but `indices` has 1"):
        K.scatter_add_(d, torch.ones(2), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`dense` must be float32, float64, float16 or bfloat16, got Long"):
        K.scatter_add_(torch.zeros(3, dtype=torch.long), torch.ones(1), torch.tensor([0], dtype=torch.int32))
    assert torch.equal(d, torch.zeros(10))  # nothing written by a rejected call


@pytest.mark.parametrize("dtype", FLOATS)
def test_ef_remove(dtype):
    r = _rand(50, 11, dtype) + 10
    idx = torch.tensor([0, 7, 7, 49], dtype=torch.int32)
    ref = r.clone()
    ref[idx.long()] = 0
    out = K.ef_remove_(r, idx)
    assert out is r and torch.equal(r, ref)
    assert int((r == 0).sum()) == 3
    K.ef_remove_(r, torch.zeros(0, dtype=torch.int32))
    assert torch.equal(r, ref)


@pytest.mark.parametrize("dtype", FLOATS)
def test_ef_remove_only_what_was_kept(dtype):
    """kept: zero only the entries of indices that kept (ascending) also holds, against torch.isin."""
    g = torch.Generator().manual_seed(5)
    for n, k in ((1000, 300), (64 * 7 + 3, 64 * 7 + 3), (20000, 5000)):
        r = _rand(n, 11, dtype) + 10
        idx = torch.randperm(n, generator=g)[:k].to(torch.int32)  # unsorted, as a caller may hold them
        kept = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
        ref = r.clone()
        ref[idx[torch.isin(idx, kept)].long()] = 0
        assert K.ef_remove_(r, idx, kept=kept) is r and torch.equal(r, ref), (n, k)
        if k < n:
            assert int((r == 0).sum()) < k  # not every sent entry was kept
        before = r.clone()
        K.ef_remove_(r, idx, kept=torch.zeros(0, dtype=torch.int32))
        assert torch.equal(r, before)  # nothing kept: nothing zeroed


def test_ef_remove_bad_arguments():
    r = torch.ones(5)
    with pytest.raises(ValueError, match=r"ef_remove_: index 5 out of range \[0, 5\)"):
        K.ef_remove_(r, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"ef_remove_: index -1 out of range \[0, 5\)"):
        K.ef_remove_(r, torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`indices` must be int32, got Long"):
        K.ef_remove_(r, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"`residual` must be contiguous"):
        K.ef_remove_(torch.ones(10)[::2], torch.tensor([1], dtype=torch.int32))
    i = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"ef_remove_: `kept` must be strictly ascending; position 1 has 1 after 2"):
        K.ef_remove_(r, i, kept=torch.tensor([2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"ef_remove_: kept index 5 out of range \[0, 5\)"):
        K.ef_remove_(r, i, kept=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`kept` must be int32, got Long"):
        K.ef_remove_(r, i, kept=torch.tensor([1]))
    assert torch.equal(r, torch.ones(5))  # nothing written by a rejected call


def test_sparse_bad_arguments():
    with pytest.raises(ValueError, match=r"sparse_normalize: `indices` must be int32, got Long"):
        K.sparse_normalize(torch.ones(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"sparse_normalize: `values` must be float32.*got Long"):
        K.sparse_normalize(torch.ones(2, dtype=torch.long), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`values` has 2 elements but `indices` has 3"):
        K.sparse_normalize(torch.ones(2), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`values` must be contiguous"):
        K.sparse_normalize(torch.ones(4)[::2], torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must be 1-D, got shapes \[2, 2\]"):
        K.sparse_normalize(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"index -2 at position 1 is out of range"):
        K.sparse_normalize(torch.ones(2), torch.tensor([0, -2], dtype=torch.int32))


def test_version():
    assert bagua_lite.__version__


# ---- the non-finite checks folded into the passes that fill buckets (C++: all_finite, scale_checked, add_checked)
@pytest.mark.parametrize("where", [None, 0, 65535, 65536, 200_000 - 1], ids=lambda w: f"bad@{w}")
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_checked_kernels_against_numpy(where, bad, dtype):
    from bagua_lite import _C
    n = 200_000  # more than one 65536-element block of the early-exit check
    a, b = _rand(n, 1).to(dtype), _rand(n, 2).to(dtype)
    if where is not None:
        b[where] = bad
    finite = bool(np.isfinite(b.float().numpy()).all())
    assert finite == (where is None)
    assert _C.all_finite(b) is finite
    out = torch.full_like(a, 7.0)
    assert _C.scale_checked(out, b, 0.5) is finite
    torch.testing.assert_close(out, b * 0.5, equal_nan=True, rtol=0, atol=0)
    out = torch.full_like(a, 7.0)
    assert _C.add_checked(out, a, b) is finite
    # a + b when b is finite; otherwise exactly a (an error-feedback residual left as it was)
    torch.testing.assert_close(out, a + b if finite else a, rtol=0, atol=0)
    # out aliasing a (accumulate in place): a bad b must leave a untouched
    a2 = a.clone()
    assert _C.add_checked(a2, a2, b) is finite
    torch.testing.assert_close(a2, a + b if finite else a, rtol=0, atol=0)
    # a strided view takes the generic path with the same result
    strided = torch.full((2 * n,), 7.0, dtype=dtype)[::2]
    assert _C.add_checked(strided, a, b) is finite
    torch.testing.assert_close(strided, a + b if finite else a, rtol=0, atol=0)


@pytest.mark.parametrize("where", [None, 0, 65536, 200_000 - 1], ids=lambda w: f"bad@{w}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_scale_flagged_is_scale_checked_with_the_answer_in_a_flag(where, dtype):
    """The check a GPU bucket leaves on the device: the slot exactly as scale_checked writes it, and the flag
    set to 1 by a non-finite source, left alone (never cleared) by a finite one."""
    from bagua_lite import _C
    n = 200_000
    src = _rand(n, 3).to(dtype)
    if where is not None:
        src[where] = float("nan")
    want = torch.full_like(src, 7.0)
    finite = _C.scale_checked(want, src, 0.25)
    for start in (0, 1):
        out, flag = torch.full_like(src, 7.0), torch.tensor([start], dtype=torch.int32)
        _C.scale_flagged_(out, src, 0.25, flag)
        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        assert flag.item() == (start if finite else 1)
    out, flag = torch.full_like(src, 7.0), torch.zeros(1, dtype=torch.int32)
    _C.scale_flagged_(out, None, 0.25, flag)  # no gradient: zeros, and nothing to flag
    assert not out.any() and flag.item() == 0
    with pytest.raises(Exception, match="flag.*int32"):
        _C.scale_flagged_(out, src, 1.0, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("where", [None, 0, 65536, 200_000 - 1], ids=lambda w: f"bad@{w}")
@pytest.mark.parametrize("wd", [0.0, 0.01], ids=["no_decay", "decay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_momentum_add_checked_against_numpy(where, wd, dtype):
    """topk/gtopk's momentum correction in one pass: u' = m u + g (+ wd w), acc = residual + u'; a
    non-finite (or absent) g is left out, so the momentum only decays and nothing bad enters acc."""
    from bagua_lite import _C
    n, m = 200_000, 0.9
    u, r, g, w = (_rand(n, s).to(dtype) for s in (1, 2, 3, 4))
    if where is not None:
        g[where] = float("nan")
    finite = where is None
    f64 = {k: t.double().numpy() for k, t in dict(u=u, r=r, g=g, w=w).items()}
    want_u = m * f64["u"] + (f64["g"] + wd * f64["w"] if finite else 0.0)
    for strided in (False, True):  # strided outputs take the generic (ATen) path
        u_out = torch.full((2 * n,), 7.0, dtype=dtype)[::2] if strided else torch.full_like(u, 7.0)
        acc = torch.full_like(u, 7.0)
        assert _C.momentum_add_checked(u_out, acc, u, r, g, m, w if wd else None, wd) is finite
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(u_out.double().numpy(), want_u, **tol)
        np.testing.assert_allclose(acc.double().numpy(), f64["r"] + u_out.double().numpy(), **tol)
    # no gradient at all: the momentum decays, and that is not a failure
    u_out, acc = torch.empty_like(u), torch.empty_like(u)
    assert _C.momentum_add_checked(u_out, acc, u, r, None, m) is True
    np.testing.assert_allclose(u_out.double().numpy(), m * f64["u"], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_sgd_step_against_numpy(dtype):
    """w -= lr * flat at each distinct index (duplicates once), per parameter slot with its own lr;
    positions outside the slots handed in (another optimizer's, or a gap) stay untouched."""
    _C = bagua_lite._C
    g = torch.Generator().manual_seed(5)
    sizes, offsets, lrs = [7, 1, 300, 40], [0, 7, 10, 310], [0.1, 0.5, 0.03, 2.0]  # a gap at 8..9
    n = 360                                                                        # a tail at 350..359
    params = [torch.randn(s, generator=g, dtype=dtype) for s in sizes]
    flat = torch.randn(n, generator=g, dtype=dtype)
    idx = torch.randint(0, n, (200,), generator=g, dtype=torch.int32)
    idx = torch.cat([idx, idx[:50], torch.tensor([0, 6, 7, 8, 9, 10, 349, 350, 359], dtype=torch.int32)])
    want = [p.numpy().copy() for p in params]
    for i in sorted(set(idx.tolist())):
        for w, off, lr in zip(want, offsets, lrs):
            if off <= i < off + len(w):
                w[i - off] -= lr * flat[i].item()
    hand_in = [0, 2, 3]  # param 1 belongs to another optimizer: not handed in
    _C.sparse_sgd_step_([params[j] for j in hand_in], [offsets[j] for j in hand_in], flat, idx,
                        [lrs[j] for j in hand_in])
    for j, (p, w) in enumerate(zip(params, want)):
        if j == 1:
            assert not np.array_equal(p.numpy(), w)  # its entry 7 was in idx, and it was left alone
            continue
        np.testing.assert_allclose(p.numpy(), w, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-7)
    # a second call with the same indices applies again (the duplicate-tracking state is per call)
    before = params[0].clone()
    _C.sparse_sgd_step_([params[0]], [0], flat, torch.tensor([3, 3], dtype=torch.int32), [1.0])
    assert float(params[0][3]) == pytest.approx(float(before[3] - flat[3]), rel=1e-6)


def test_sparse_sgd_step_rejects_bad_arguments():
    _C = bagua_lite._C
    flat, p = torch.zeros(10), torch.zeros(4)
    ok = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="index 10 out of range"):
        _C.sparse_sgd_step_([p], [0], flat, torch.tensor([10], dtype=torch.int32), [0.1])
    with pytest.raises(ValueError, match="int32"):
        _C.sparse_sgd_step_([p], [0], flat, torch.tensor([1]), [0.1])
    with pytest.raises(ValueError, match="is not an ascending, non-overlapping slot"):
        _C.sparse_sgd_step_([p, p], [0, 2], flat, ok, [0.1, 0.1])
    with pytest.raises(ValueError, match="is not an ascending, non-overlapping slot"):
        _C.sparse_sgd_step_([p], [8], flat, ok, [0.1])
    with pytest.raises(ValueError, match="one each"):
        _C.sparse_sgd_step_([p], [0], flat, ok, [])
    with pytest.raises(ValueError, match="of flat's dtype"):
        _C.sparse_sgd_step_([p.double()], [0], flat, ok, [0.1])


# ---- block maxima: the error-feedback writers leave per-64-element bounds for topk_out(block_max=...)

@pytest.mark.parametrize("writer", ["momentum", "momentum_decay", "momentum_no_grad", "momentum_nan_grad", "add",
                                    "add_nan", "add_strided", "combine"])
def test_block_max_writers(writer):
    """Written slice by slice (cuts inside blocks), the bounds equal each block's largest key of the final
    output (an inf/NaN in a non-finite first pass may only raise them), and the outputs are exactly those
    of the call without bounds."""
    from bagua_lite import _C
    n, m, wd = 10_037, 0.9, 0.01
    u, r, g, w = (_rand(n, s) for s in (1, 2, 3, 4))
    if writer.endswith("nan_grad") or writer == "add_nan":
        g[70] = float("nan")  # in block 1
    bm = torch.zeros((n + 63) // 64, dtype=torch.int32)
    cuts = [0, 13, 64, 100, 1000, 1001, 5000, n]
    want_u, want_acc = torch.empty(n), torch.empty(n)
    got_u, got_acc = torch.empty(n), torch.empty(n)
    for lo, hi in zip(cuts, cuts[1:]):
        s = slice(lo, hi)
        if writer.startswith("momentum"):
            gg = None if writer == "momentum_no_grad" else g[s]
            ww, dd = (w[s], wd) if writer == "momentum_decay" else (None, 0.0)
            a = _C.momentum_add_checked(want_u[s], want_acc[s], u[s], r[s], gg, m, ww, dd)
            b = _C.momentum_add_checked(got_u[s], got_acc[s], u[s], r[s], gg, m, ww, dd, bm, lo)
            assert a == b
        elif writer.startswith("add"):
            out = torch.empty(2 * (hi - lo))[::2] if writer == "add_strided" else got_acc[s]
            a = _C.add_checked(want_acc[s], r[s], g[s])
            if writer == "add_strided":  # a strided output has no float32 fast path: the bounds are refused
                with pytest.raises(RuntimeError, match="block_max needs a contiguous CPU float32 output"):
                    _C.add_checked(out, r[s], g[s], bm, lo)
                return
            assert _C.add_checked(out, r[s], g[s], bm, lo) == a
        else:
            want_acc[s] = r[s] * 3
            got_acc[s] = r[s] * 3
            bagua_lite.kernels.block_max_combine_(bm, got_acc[s], lo)
    assert torch.equal(got_acc, want_acc)
    if writer.startswith("momentum"):
        assert torch.equal(got_u, want_u)
    exact = block_bounds(want_acc)
    assert bool((bm >= exact).all()), "a bound below its block's largest key"
    raised = torch.nonzero(bm != exact).flatten().tolist()
    assert raised == ([1] if "nan" in writer else []), raised


def test_block_max_writer_arguments_named():
    from bagua_lite import _C
    x, y = torch.ones(130), torch.ones(130)
    with pytest.raises(RuntimeError, match=r"block_max has 2 blocks; elements \[0, 130\) of the bucket need 3"):
        _C.add_checked(torch.empty(130), x, y, torch.zeros(2, dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match=r"block_max has 3 blocks; elements \[70, 200\) of the bucket need 4"):
        _C.add_checked(torch.empty(130), x, y, torch.zeros(3, dtype=torch.int32), 70)
    with pytest.raises(RuntimeError, match="block_max must be a contiguous CPU int32 tensor, got Float"):
        _C.momentum_add_checked(torch.empty(130), torch.empty(130), x, y, y, 0.9, None, 0.0, torch.zeros(3), 0)
    with pytest.raises(RuntimeError, match="block_offset must be >= 0, got -1"):
        bagua_lite.kernels.block_max_combine_(torch.zeros(3, dtype=torch.int32), x, -1)


@pytest.mark.parametrize("compression", ["fp16", "bf16", "minmax_uint8", "sign"])
def test_codec_refuses_a_wire_on_another_device(compression):
    """The CPU loops read raw pointers: a wire buffer on another device (a CUDA one, here the meta device
    standing in) must be refused with the op and both devices named, never dereferenced."""
    from bagua_lite import _C
    x = torch.randn(37)
    wire = torch.empty(_C.wire_bytes(compression, 37), dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=rf"{compression}.*wire buffer is on meta but the values are on cpu"):
        _C.compress_into(x, compression, wire)
    with pytest.raises(ValueError, match=rf"{compression}.*wire buffer is on meta but the values are on cpu"):
        _C.decompress_into(wire, compression, x, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_copy_flagged_copies_only_where_a_flag_is_set(dtype):
    """dst = src where any of the flags is nonzero, else dst untouched (bit for bit): the state a discarded
    round puts back on the device (bagua_lite.verdict)."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 4099):
        src, dst = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        before = dst.clone()
        for flags, copied in (([0], False), ([0, 0, 0], False), ([0, 2, 0], True), ([-1], True)):
            dst.copy_(before)
            bagua_lite._C.copy_flagged_(dst, src, torch.tensor(flags, dtype=torch.int32))
            assert torch.equal(dst, src if copied else before), (n, flags)
    odd = torch.randn(9, generator=g)
    bagua_lite._C.copy_flagged_(odd[1:], odd[:-1].clone(), torch.ones(1, dtype=torch.int32))  # an unaligned view


def test_copy_flagged_bad_arguments():
    x = torch.zeros(4)
    for args, what in (((x, torch.zeros(5), torch.zeros(1, dtype=torch.int32)), "size"),
                       ((x, torch.zeros(4, dtype=torch.float64), torch.zeros(1, dtype=torch.int32)), "dtype"),
                       ((x, torch.zeros(4), torch.zeros(1)), "int32"),
                       ((x, torch.zeros(8)[::2], torch.zeros(1, dtype=torch.int32)), "contiguous")):
        with pytest.raises(ValueError, match="copy_flagged_") as e:
            bagua_lite._C.copy_flagged_(*args)
        assert what in str(e.value), (what, str(e.value))


def test_merge_topk_nan_ranks_first_then_magnitude_then_index():
    """A NaN (given, or inf + -inf summed on a shared index) outranks every magnitude, as in torch.topk and
    our topk kernel; NaNs among themselves, and equal magnitudes, go to the lower index. The selection needs
    a strict weak order for this to be defined at all: several NaNs among many entries."""
    nan = float("nan")
    for trial in range(30):
        universe = [60, 2_000][trial % 2]
        av, ai = _canonical(min(40 + trial, universe), universe, 300 + trial, int_valued=True)
        bv, bi = _canonical(min(35 + trial, universe), universe, 400 + trial, int_valued=True)
        g = torch.Generator().manual_seed(trial)
        av[torch.randperm(av.numel(), generator=g)[:3]] = nan
        bv[trial % bv.numel()] = float("inf")
        pos_a = {i: p for p, i in enumerate(ai.tolist())}
        pos_b = {i: p for p, i in enumerate(bi.tolist())}
        for sign, idx in zip((1.0, -1.0), sorted(set(pos_a) & set(pos_b))[:2]):  # inf + -inf = NaN
            av[pos_a[idx]], bv[pos_b[idx]] = sign * float("inf"), -sign * float("inf")
        union = {}
        for v, i in zip(av.tolist(), ai.tolist()):
            union[i] = v
        for v, i in zip(bv.tolist(), bi.tolist()):
            union[i] = union[i] + v if i in union else v
        assert sum(math.isnan(v) for v in union.values()) >= 3
        rank = lambda i: (0, 0.0, i) if math.isnan(union[i]) else (1, -abs(union[i]), i)  # noqa: E731
        for k in (1, 3, 5, 8, len(union) // 2, len(union) - 1):
            ref = sorted(sorted(union, key=rank)[:k])
            want = np.array([union[i] for i in ref], dtype=np.float32)
            for x, y in (((av, ai), (bv, bi)), ((bv, bi), (av, ai))):
                ov, oi = K.merge_topk(*x, *y, k)
                assert oi.tolist() == ref, (trial, k)
                assert np.array_equal(ov.numpy(), want, equal_nan=True), (trial, k)
