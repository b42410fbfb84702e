"""bagua_lite.comm on real gloo groups (P = 1, 2, 3, 4, 5, 8 spawned ranks on loopback).

Every rank generates every rank's input from (seed, rank), so each rank computes the reference itself
with plain torch/numpy and checks its own result; the per-rank results' hashes come back to the test,
which checks that ranks agree bit-for-bit where the API promises it. Each remote function batches many
checks so that a world size costs a handful of round trips.
"""
import hashlib
import os
import re
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import bagua_lite
from bagua_lite import _C
from bagua_lite import comm as C
from bagua_lite import kernels as K

from cluster import Cluster, RemoteError

SEED = 1234


# ---------------------------------------------------------------------------------------------------------
# helpers (used on the ranks)


def _gen(seed, rank, tag):
    return torch.Generator().manual_seed((seed * 1_000_003 + rank * 7919 + tag) % (2 ** 62))


def _data(seed, rank, n, dtype=torch.float32, tag=0):
    g = _gen(seed, rank, tag)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def _sha(t):
    t = t.contiguous()
    return f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha1(t.view(torch.uint8).numpy().tobytes()
                                                       if t.numel() else b"").hexdigest()


def _expect(exc, pattern, fn, *args, **kwargs):
    """fn(*args) must raise exc with a message matching pattern; returns the message."""
    try:
        fn(*args, **kwargs)
    except exc as e:
        msg = str(e)
        assert re.search(pattern, msg), f"{fn.__name__}: message {msg!r} does not match {pattern!r}"
        return msg
    raise AssertionError(f"{fn.__name__}{args!r}: expected {exc.__name__} matching {pattern!r}, nothing raised")


def _chunks(n, P):
    return [(i * (n // P) + min(i, n % P), n // P + (1 if i < n % P else 0)) for i in range(P)]


# ---------------------------------------------------------------------------------------------------------
# allreduce


def _r_allreduce(rank, P, seed):
    hashes = {}
    cases = [(torch.float32, n) for n in (0, 1, 7, 1001, 1_000_003)]
    cases += [(torch.float64, n) for n in (0, 1, 5, 777, 300_001)]
    for dtype, n in cases:
        xs = [_data(seed, r, n, dtype, tag=n) for r in range(P)]
        ref_sum = torch.stack(xs).double().sum(0) if n else torch.zeros(0, dtype=torch.float64)
        for op in ("avg", "sum"):
            t = xs[rank].clone()
            out = C.allreduce(t, op=op)
            assert out is t and t.dtype == dtype and t.shape == (n,)
            ref = ref_sum / P if op == "avg" else ref_sum
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            assert torch.allclose(t.double(), ref, rtol=tol, atol=tol * P), (dtype, n, op)
            if P == 1:
                assert torch.equal(t, xs[0])  # nothing to reduce: untouched
            hashes[(str(dtype), n, op)] = _sha(t)
    # Integer sums are exact.
    xs = [_data(seed, r, 513, torch.int64, tag=5) for r in range(P)]
    t = xs[rank].clone()
    C.allreduce(t, op="sum")
    assert torch.equal(t, torch.stack(xs).sum(0))
    # 2-D tensors reduce elementwise and keep their shape.
    xs = [_data(seed, r, 60, tag=6).view(6, 10) for r in range(P)]
    t = xs[rank].clone()
    C.allreduce(t)
    assert t.shape == (6, 10) and torch.allclose(t, torch.stack(xs).mean(0), atol=1e-6)
    return hashes


def test_allreduce(cluster):
    res = cluster.run(_r_allreduce, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after allreduce"
    assert len(res[0]) == 20


def _r_allreduce_start(rank, P, seed):
    """allreduce_start gives allreduce's bits, with another collective issued while it is in flight."""
    out = []
    for n, op in ((1, "avg"), (1000, "avg"), (100_003, "avg"), (777, "sum")):
        x = _data(seed, rank, n, tag=7)
        ref = C.allreduce(x.clone(), op)
        C.reset_traffic()
        t = x.clone()
        pending = C.allreduce_start(t, op)
        steps = torch.tensor([rank], dtype=torch.int64)
        C.allreduce(steps, "sum")  # issued before the first one is waited for
        assert pending.wait() is t and pending.wait() is t  # a second wait changes nothing
        assert int(steps) == P * (P - 1) // 2
        assert torch.equal(t.view(torch.int32), ref.view(torch.int32)), (n, op)
        assert C.bytes_sent() == 2 * (P - 1) * t.nbytes // P + 2 * (P - 1) * 8 // P  # as allreduce counts both
        out.append(_sha(t))
    with pytest.raises(ValueError, match=r"allreduce_start: op='max' is not allowed"):
        C.allreduce_start(torch.zeros(3), "max")
    with pytest.raises(ValueError, match=r"allreduce_start\(op='avg'\): t must be floating point"):
        C.allreduce_start(torch.zeros(3, dtype=torch.int64))
    return out


def test_allreduce_start_same_bits_as_allreduce(cluster):
    res = cluster.run(_r_allreduce_start, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after allreduce_start"


# ---------------------------------------------------------------------------------------------------------
# compressed_allreduce


def _compressed_reference(xs, compression, average):
    """Python re-implementation of compressed_allreduce (see the docstring / compressed_allreduce.cpp)."""
    P, n, dtype = len(xs), xs[0].numel(), xs[0].dtype
    out = torch.empty(n, dtype=dtype)
    bound = torch.zeros(n, dtype=torch.float64)
    for b, ln in _chunks(n, P):
        acc = None
        for r in range(P):
            piece = xs[r][b:b + ln]
            dec = K.decompress(K.compress(piece, compression), compression, ln, dtype)
            acc = dec.clone() if acc is None else acc + dec
            if ln:
                if compression == "fp16":
                    bound[b:b + ln] += piece.double().abs() * 2.0 ** -11 / (P if average else 1)
                else:
                    step = (piece.float().max() - piece.float().min()).double() / 255
                    bound[b:b + ln] += step / 2 / (P if average else 1)
        if average:
            acc = acc / P
        out[b:b + ln] = K.decompress(K.compress(acc, compression), compression, ln, dtype)
        if ln:
            if compression == "fp16":
                bound[b:b + ln] += acc.double().abs() * 2.0 ** -11
            else:
                bound[b:b + ln] += (acc.float().max() - acc.float().min()).double() / 255 / 2
    return out, bound


def _r_compressed(rank, P, seed):
    hashes = {}
    sizes = sorted({0, 1, max(P - 1, 0), P + 1, 1000, 65_537})
    for compression in ("fp16", "minmax_uint8"):
        for dtype in (torch.float32, torch.float64):
            for n in sizes:
                xs = [_data(seed, r, n, dtype, tag=n + 1) * (r + 1) for r in range(P)]
                for op in ("avg", "sum"):
                    t = xs[rank].clone()
                    out = C.compressed_allreduce(t, compression=compression, op=op)
                    assert out is t and t.shape == (n,) and t.dtype == dtype
                    key = (compression, str(dtype), n, op)
                    if P == 1:
                        assert torch.equal(t, xs[0]), key  # documented: left exactly as it is
                    else:
                        ref, bound = _compressed_reference(xs, compression, op == "avg")
                        bad = (t != ref).nonzero().flatten()[:5].tolist()
                        assert torch.equal(t, ref), (key, bad, t[bad].tolist(), ref[bad].tolist())
                        true = torch.stack(xs).double().sum(0) if n else torch.zeros(0, dtype=torch.float64)
                        if op == "avg":
                            true = true / P
                        err = (t.double() - true).abs()
                        slack = 1e-6 * (1 + true.abs()) * P
                        assert torch.all(err <= bound * 1.001 + slack), (key, (err - bound).max().item())
                    hashes[key] = _sha(t)
    # A 2-D tensor: chunks are over the flat view.
    x = _data(seed, rank, 120, tag=99).view(12, 10)
    C.compressed_allreduce(x, "minmax_uint8")
    hashes["2d"] = _sha(x)
    return hashes


def test_compressed_allreduce(cluster):
    res = cluster.run(_r_compressed, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after compressed_allreduce"


# ---------------------------------------------------------------------------------------------------------
# sparse_allreduce


def _sparse_inputs(seed, r, P, numel, dtype, case):
    g = _gen(seed, r, 50 + case)
    if case == 0:
        k = 0 if (r == 0 and P > 1) or r == 3 else int(torch.randint(1, 40, (1,), generator=g))
    elif case == 1:
        k = 0  # everyone empty
    elif case == 3:
        k = 9  # the same k on every rank (Top-k's case: sparse_allgather may be told k)
    else:
        k = 5 * (r + 1)
    if numel == 0:
        k = 0
    idx = torch.randint(0, max(numel, 1), (k,), generator=g, dtype=torch.int32)
    if k >= 3:
        idx[1] = idx[0]  # a duplicate within the rank
        idx[2] = idx[0]
    val = torch.randn(k, generator=g, dtype=torch.float64).to(dtype)
    return val, idx


def _r_sparse(rank, P, seed):
    hashes = {}
    for dtype in (torch.float32, torch.float64):
        for case, numel in ((0, 1000), (0, 7), (1, 1000), (2, 50), (1, 0), (3, 100)):
            ins = [_sparse_inputs(seed, r, P, numel, dtype, case) for r in range(P)]
            v, i = ins[rank]
            out = C.sparse_allreduce(v.clone(), i.clone(), numel)
            assert out.dtype == dtype and out.shape == (numel,)
            ref = np.zeros(numel, dtype=v.numpy().dtype)
            for rv, ri in ins:  # rank order, then position order: the documented summation order
                np.add.at(ref, ri.numpy(), rv.numpy())
            assert np.array_equal(out.numpy(), ref), (str(dtype), case, numel)
            dense64 = torch.zeros(numel, dtype=torch.float64)
            for rv, ri in ins:
                dense64.index_add_(0, ri.long(), rv.double())
            assert torch.allclose(out.double(), dense64, atol=1e-5)
            assert torch.equal(v, ins[rank][0]) and torch.equal(i, ins[rank][1])  # inputs untouched
            hashes[(str(dtype), case, numel)] = _sha(out)
            # the same exchange without the sum: every rank's pairs, concatenated in rank order
            gv, gi = C.sparse_allgather(v.clone(), i.clone())
            assert gv.dtype == dtype and gi.dtype == torch.int32
            assert torch.equal(gv, torch.cat([rv for rv, _ in ins])), (str(dtype), case, numel)
            assert torch.equal(gi, torch.cat([ri for _, ri in ins])), (str(dtype), case, numel)
            if len({len(rv) for rv, _ in ins}) == 1:  # told k: no size exchange, the same pairs
                kv, ki = C.sparse_allgather(v.clone(), i.clone(), k=len(v))
                assert torch.equal(kv, gv) and torch.equal(ki, gi), (str(dtype), case, numel)
                uv, ui = C.sparse_allgather(v.clone(), i.clone(), k=len(v), verify=False)  # a verified repeat
                assert torch.equal(uv, gv) and torch.equal(ui, gi), (str(dtype), case, numel)
    return hashes


def _r_sparse_allgather_k_mismatch(rank, P):
    # rank 0: 2 float64 pairs, the others 3 float32 pairs: 40 bytes each with the header, so the exchange
    # completes and every receiver's check of the header must name the rank that differs
    v = torch.ones(2, dtype=torch.float64) if rank == 0 else torch.ones(3)
    i = torch.arange(len(v), dtype=torch.int32)
    try:
        C.sparse_allgather(v, i, k=len(v))
    except ValueError as e:
        return str(e)
    return None


def test_sparse_allgather_with_k_checks_every_peers_k_and_dtype(cluster):
    res = cluster.run(_r_sparse_allgather_k_mismatch)
    if len(res) == 1:
        assert res == [None]  # nobody to differ from
        return
    assert re.search(r"rank 1 sent k=3 pairs of dtype Float but this rank \(0\) expects k=2 of dtype Double", res[0]), res[0]
    for r in range(1, len(res)):
        assert re.search(rf"rank 0 sent k=2 pairs of dtype Double but this rank \({r}\) expects k=3 of dtype Float",
                         res[r]), res[r]


def test_sparse_allreduce(cluster):
    res = cluster.run(_r_sparse, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after sparse_allreduce"


# ---------------------------------------------------------------------------------------------------------
# gtopk_allreduce


def _simulate_gtopk(sets, k, union=False):
    """The documented algorithm on one process, with the library's own merge kernel (``union``: the last
    round keeps the whole merged set, up to 2k)."""
    P = len(sets)
    empty_v, empty_i = sets[0][0][:0], torch.zeros(0, dtype=torch.int32)
    S = []
    for v, i in sets:
        nv, ni = K.sparse_normalize(v, i)
        S.append(K.merge_topk(nv, ni, empty_v, empty_i, k))
    if P == 1 or k == 0:
        return S
    core = 1
    while core * 2 <= P:
        core *= 2
    for r in range(core, P):
        S[r - core] = K.merge_topk(*S[r - core], *S[r], k)
    d = 1
    while d < core:
        keep = 2 * k if union and 2 * d >= core else k
        S[:core] = [K.merge_topk(*S[r], *S[r ^ d], keep) for r in range(core)]
        d *= 2
    for r in range(core, P):
        S[r] = S[r - core]
    return S


def _gtopk_expected_bytes(rank, P, k, elem, count, exact, msg=None, back=None):
    if P == 1 or k == 0:
        return 0
    core = 1
    while core * 2 <= P:
        core *= 2
    msg = k * (elem + 4) if msg is None else msg
    back = msg if back is None else back  # the unfold's message (laid out for 2k under final_union)
    rounds = core.bit_length() - 1
    if rank >= core:
        b = msg                      # fold send
    elif rank + core < P:
        b = rounds * msg + back      # rounds + unfold send
    else:
        b = rounds * msg
    if exact and count > 0:
        b += 2 * (P - 1) * count * elem // P  # one allreduce of the selected values
    return b


def _union_dense(sets, numel):
    dense = torch.zeros(numel, dtype=torch.float64)
    present = torch.zeros(numel, dtype=torch.bool)
    for v, i in sets:
        dense.index_add_(0, i.long(), v.double())
        present[i.long()] = True
    return dense, present


def _r_gtopk(rank, P, seed):
    hashes = {}
    numel = 5000

    # (a) Disjoint indices across ranks, integer values (many magnitude ties): exactly the global top-k.
    perm = torch.randperm(numel, generator=_gen(seed, 0, 70)).to(torch.int32)
    sets = []
    for r in range(P):
        g = _gen(seed, r, 71)
        mine = perm[r::P][: int(torch.randint(0, 300, (1,), generator=g))]
        mine = mine[torch.randperm(mine.numel(), generator=g)]  # not sorted: gtopk normalizes
        sets.append((torch.randint(-9, 10, (mine.numel(),), generator=g).float(), mine.clone()))
    uv = torch.cat([s[0] for s in sets])
    ui = torch.cat([s[1] for s in sets])
    for k in (0, 1, 7, 64, 299, uv.numel(), uv.numel() + 50):
        v, i = C.gtopk_allreduce(sets[rank][0].clone(), sets[rank][1].clone(), k)
        order = sorted(range(uv.numel()), key=lambda j: (-abs(float(uv[j])), int(ui[j])))[:k]
        order.sort(key=lambda j: int(ui[j]))
        assert i.dtype == torch.int32 and v.dtype == torch.float32
        assert i.tolist() == [int(ui[j]) for j in order], ("disjoint", k)
        assert v.tolist() == [float(uv[j]) for j in order], ("disjoint", k)
        hashes[("disjoint", k)] = (_sha(v), _sha(i))

    # (b) Overlapping sets with duplicates within a rank, some ranks empty; float32 and float64.
    for dtype in (torch.float32, torch.float64):
        for int_valued in (True, False):
            sets = []
            for r in range(P):
                g = _gen(seed, r, 80 + int_valued)
                m = 0 if (r == 1 and P > 2) else int(torch.randint(1, 120, (1,), generator=g))
                idx = torch.randint(0, 300, (m,), generator=g, dtype=torch.int32)
                if int_valued:
                    val = torch.randint(-6, 7, (m,), generator=g).to(dtype)
                else:
                    val = torch.randn(m, generator=g, dtype=torch.float64).to(dtype)
                sets.append((val, idx))
            dense, present = _union_dense(sets, 300)
            n_union = int(present.sum())
            sim_cache = {}
            for k in (0, 1, 16, 100, n_union, 1000):
                for exact in (False, True):
                    C.reset_traffic()
                    v, i = C.gtopk_allreduce(sets[rank][0].clone(), sets[rank][1].clone(), k, exact=exact)
                    sent = C.bytes_sent()
                    key = (str(dtype), int_valued, k, exact)
                    assert i.dtype == torch.int32 and v.dtype == dtype, key
                    assert v.numel() == i.numel() <= k, key
                    assert v.numel() == min(k, n_union), key
                    assert torch.all(i[1:] > i[:-1]), key
                    assert torch.all(present[i.long()]), key
                    if k not in sim_cache:
                        sim_cache[k] = _simulate_gtopk(sets, k)
                    sv, si = sim_cache[k][rank]
                    assert torch.equal(i, si), key
                    if exact:
                        # Each value is the exact sum over ranks at its index.
                        assert torch.allclose(v.double(), dense[i.long()], rtol=1e-12 if dtype == torch.float64
                                              else 1e-6, atol=1e-6), key
                        if int_valued:
                            assert torch.equal(v.double(), dense[i.long()]), key
                    else:
                        assert torch.equal(v.view(torch.uint8), sv.view(torch.uint8)), key
                    if k >= n_union and int_valued:
                        # Nothing is ever dropped: the full union with exact sums.
                        assert torch.equal(i.long(), present.nonzero().flatten()), key
                        assert torch.equal(v.double(), dense[i.long()]), key
                    elem = torch.tensor([], dtype=dtype).element_size()
                    expected = _gtopk_expected_bytes(rank, P, k, elem, v.numel(), exact)
                    assert sent == expected, (key, sent, expected)
                    hashes[key] = (_sha(v), _sha(i))

    # (d) final_union on (b)'s last sets (float64), exact or not: the simulation's last round keeps the whole
    # union (up to 2k); exact values are the dense sums there.
    for k in (16, 100):
        su_v, su_i = _simulate_gtopk(sets, k, union=True)[rank]
        for exact in (False, True):
            v, i = C.gtopk_allreduce(sets[rank][0].clone(), sets[rank][1].clone(), k, exact=exact, final_union=True)
            assert torch.equal(i, su_i) and i.numel() <= 2 * k, ("union", k, exact)
            if exact:
                assert torch.allclose(v, dense[i.long()], rtol=1e-12, atol=1e-12), ("union", k, exact)
            else:
                assert torch.equal(v, su_v), ("union", k, exact)
            hashes[("union", k, exact)] = (_sha(v), _sha(i))
    if P == 2 or P >= 4:  # the last round's two sets overlap only in part (at P = 3 one of them is empty)
        assert _simulate_gtopk(sets, 16, union=True)[rank][1].numel() > 16

    # (c) A rank-local input longer than k, already canonical, P = any: result still canonical, <= k.
    x = _data(seed, rank, 2000, tag=90)
    li = x.abs().topk(50).indices.sort().values
    lv, li = x[li].clone(), li.to(torch.int32)
    C.reset_traffic()
    v, i = C.gtopk_allreduce(lv, li, 20)
    assert C.bytes_sent() == _gtopk_expected_bytes(rank, P, 20, 4, v.numel(), False)
    assert v.numel() == 20 and torch.all(i[1:] > i[:-1])
    hashes["topk-input"] = (_sha(v), _sha(i))
    return hashes


def test_gtopk_allreduce(cluster):
    res = cluster.run(_r_gtopk, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after gtopk_allreduce"


def _r_gtopk_canonical(rank, P, seed):
    """canonical=True (the rounds as fixed-size tensor ops, as on a GPU) against the host's merge, bit for bit:
    the result, the bytes sent, and the out= buffers, over dtypes and inputs made for ties (integer values,
    all equal, sums to zero and -0.0), overlap (disjoint, identical, random) and k up to the bitmap's bound."""
    numel, hashes = 5000, {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for case in ("normal", "integers", "equal", "zeros", "disjoint", "identical"):
            for k in (1, 7, 64, 156, 157):  # 157: a bitmap is smaller, the host path runs either way
                g = _gen(seed, 0 if case == "identical" else rank, 300 + k)
                if case == "disjoint":
                    pool = torch.randperm(numel, generator=_gen(seed, 0, 301))[rank::P]
                    idx = pool[torch.randperm(pool.numel(), generator=g)[:k]]
                else:
                    idx = torch.randperm(numel if case != "equal" else 2 * k, generator=g)[:k]
                idx = idx.sort().values.to(torch.int32)
                if case in ("integers", "disjoint"):
                    val = torch.randint(-3, 4, (k,), generator=g).to(dtype)
                elif case == "equal":
                    val = torch.full((k,), -1.5 if rank % 2 else 1.5, dtype=dtype)
                elif case == "zeros":
                    val = torch.where(torch.rand(k, generator=g) < 0.5, -0.0, 0.0).to(dtype)
                    val[::5] = 2.0 * (rank + 1)
                else:
                    val = torch.randn(k, generator=g, dtype=torch.float64).to(dtype)
                key = (str(dtype), case, k)
                got = []
                for canonical in (False, True):
                    C.reset_traffic()
                    v, i = C.gtopk_allreduce(val.clone(), idx.clone(), k, numel=numel, canonical=canonical)
                    got.append((v.view(torch.uint8 if dtype != torch.float64 else torch.int64).clone(), i.clone(),
                                C.bytes_sent()))
                (hv, hi, hb), (tv, ti, tb) = got
                assert torch.equal(hi, ti) and torch.equal(hv, tv) and hb == tb, key
                assert ti.numel() == k and torch.all(ti[1:] > ti[:-1]), key
                hashes[key] = (_sha(tv), _sha(ti))
    # out= buffers kept across calls, and numel not given (an index list whatever k)
    val = _data(seed, rank, 40, tag=310)
    idx = torch.randperm(900, generator=_gen(seed, rank, 311))[:40].sort().values.to(torch.int32)
    out = (torch.empty(64), torch.empty(64, dtype=torch.int32))
    v, i = C.gtopk_allreduce(val.clone(), idx.clone(), 40, out=out, canonical=True)
    hv, hi = C.gtopk_allreduce(val.clone(), idx.clone(), 40)
    assert v.data_ptr() == out[0].data_ptr() and i.data_ptr() == out[1].data_ptr()
    assert torch.equal(v, hv) and torch.equal(i, hi)
    hashes["out"] = (_sha(v), _sha(i))
    return hashes


def test_gtopk_allreduce_canonical_rounds_equal_the_host_merge(cluster):
    res = cluster.run(_r_gtopk_canonical, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after gtopk_allreduce(canonical=True)"


def _q4(v):
    """4-bit round trip of a canonical set's values as documented: per block of 64, levels round(v / s) in
    [-7, 7] with s = the block's largest magnitude / 7 (float32 arithmetic), decoded as level * s."""
    out = torch.empty_like(v)
    for lo in range(0, v.numel(), 64):
        b = v[lo:lo + 64].float()
        s = b.abs().max() / 7
        lv = torch.round(b / s).clamp(-7, 7) + 0.0 if s > 0 else torch.zeros_like(b)  # + 0.0: levels are ints (no -0)
        out[lo:lo + 64] = (lv * s).to(v.dtype)
    return out


def _simulate_gtopk_q4(sets, k, union=False):
    """The documented 4-bit algorithm on one process: each rank's own k quantized once; a merged set
    quantized again before it is sent; the final set quantized on the core when P is not a power of two."""
    P = len(sets)
    empty_v, empty_i = sets[0][0][:0], torch.zeros(0, dtype=torch.int32)
    S, fresh = [], [True] * P
    for v, i in sets:
        nv, ni = K.sparse_normalize(v, i)
        tv, ti = K.merge_topk(nv, ni, empty_v, empty_i, k)
        S.append((_q4(tv), ti))
    own = list(S)
    if P == 1 or k == 0:
        return S, own
    core = 1
    while core * 2 <= P:
        core *= 2
    for r in range(core, P):
        S[r - core], fresh[r - core] = K.merge_topk(*S[r - core], *S[r], k), False
    d = 1
    while d < core:
        Q = [S[r] if fresh[r] else (_q4(S[r][0]), S[r][1]) for r in range(core)]
        keep = 2 * k if union and 2 * d >= core else k
        S[:core], fresh[:core] = [K.merge_topk(*Q[r], *Q[r ^ d], keep) for r in range(core)], [False] * core
        d *= 2
    if P > core:
        S[:core] = [(_q4(v), i) for v, i in S[:core]]
    for r in range(core, P):
        S[r] = S[r - core]
    return S, own


def _r_gtopk_wire(rank, P, seed):
    """The bitmap index coding and 4-bit values against the simulation, with bytes per rank counted."""
    from bagua_lite.algorithms.gtopk import GTopK
    hashes = {}
    numel = 3000
    for dtype in (torch.float32, torch.bfloat16):
        sets = []
        for r in range(P):
            g = _gen(seed, r, 95)
            m = 0 if (r == 2 and P > 3) else int(torch.randint(1, 900, (1,), generator=g))
            idx = torch.randperm(numel, generator=g)[:m].to(torch.int32)   # distinct, overlapping
            if dtype == torch.float32:
                idx = idx.sort().values  # ascending, as a top-k hands them over; bfloat16: unsorted
            sets.append(((torch.randn(m, generator=g) * torch.rand(m, generator=g) * 10).to(dtype), idx))
        for k, union in ((0, False), (1, False), (50, False), (93, False), (94, False), (200, False), (700, False),
                         (2000, False), (1, True), (47, True), (93, True), (94, True), (200, True), (700, True)):
            plain = _simulate_gtopk(sets, k, union)
            q4, own = _simulate_gtopk_q4(sets, k, union)
            for n, bits in ((numel, None), (None, 4), (numel, 4)):
                key = (str(dtype), k, n, bits, union)
                vin = sets[rank][0].clone()
                C.reset_traffic()
                v, i = C.gtopk_allreduce(vin, sets[rank][1].clone(), k, numel=n, value_bits=bits, final_union=union)
                sent = C.bytes_sent()
                sv, si = (q4 if bits else plain)[rank]
                assert torch.equal(i, si), key
                assert torch.equal(v.view(torch.uint8), sv.view(torch.uint8)), key
                if bits:
                    # values now hold what of this rank's contribution the result kept: its decoded level
                    # where it was among its k and is in the result, else 0
                    ov, oi = own[rank]
                    want = torch.zeros_like(vin)
                    pos, result = {int(x): j for j, x in enumerate(oi)}, set(si.tolist())
                    for j, x in enumerate(sets[rank][1].tolist()):
                        if x in pos and x in result:
                            want[j] = ov[pos[x]]
                    assert torch.equal(vin.view(torch.uint8), want.view(torch.uint8)), key
                    if k and dtype == torch.float32:  # at most half a level: s / 2 <= the largest / 14
                        err = (sets[rank][0].float() - vin.float()).abs()[vin != 0]
                        assert err.numel() == 0 or float(err.max()) <= float(ov.float().abs().max()) / 14 * 1.01, key
                else:
                    assert torch.equal(vin, sets[rank][0]), key  # left alone
                msg = GTopK.message_bytes(k, vin.element_size(), n, bits)
                back = GTopK.message_bytes(2 * k, vin.element_size(), n, bits) if union else msg
                expected = _gtopk_expected_bytes(rank, P, k, vin.element_size(), v.numel(), False, msg, back)
                if union and P > 1:  # what gtopk's cost model says this rank sends
                    model = GTopK.sparse_traffic({"exact": False, "value_bits": bits, "final_union": True}, P, k,
                                                 vin.element_size(), rank, n=n)[0][0]
                    assert sent == model, (key, sent, model)
                assert sent == expected, (key, sent, expected)
                hashes[key] = (_sha(v), _sha(i))
    assert GTopK.message_bytes(94, 4, numel, 4) == 4 * 2 + 47 + 375   # the bitmap from k = 94 (375 < 376)
    assert GTopK.message_bytes(93, 4, numel, None) == 93 * 8
    return hashes


def test_gtopk_allreduce_bitmap_and_4bit_values(cluster):
    res = cluster.run(_r_gtopk_wire, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after gtopk_allreduce"


# ---------------------------------------------------------------------------------------------------------
# the shift_one schedule (decentralized's peer_selection: shift_one)



def test_shift_one_schedule():
    for P in range(1, 13):
        steps = P if P % 2 else max(P - 1, 1)
        met = set()
        for step in range(steps):
            partners = [_C.shift_one_partner(r, P, step) for r in range(P)]
            for r, p in enumerate(partners):
                assert p == -1 or (0 <= p < P and p != r), (P, step, partners)
                if p >= 0:
                    assert partners[p] == r, ("not symmetric", P, step, partners)
                    pair = (min(r, p), max(r, p))
                    if r < p:
                        assert pair not in met, ("pair met twice", P, pair)
                        met.add(pair)
            idle = partners.count(-1)
            assert idle == (1 if P % 2 else 0), (P, step, partners)
            # The schedule rotates with period `steps`.
            assert partners == [_C.shift_one_partner(r, P, step + steps) for r in range(P)]
        assert len(met) == P * (P - 1) // 2, (P, len(met))


# ---------------------------------------------------------------------------------------------------------
# broadcast


def _r_broadcast(rank, P, seed):
    for src in sorted({0, P - 1}):
        for dtype, n in ((torch.float32, 10_001), (torch.int64, 33), (torch.float64, 0)):
            t = _data(seed, rank, n, dtype, tag=300 + src)
            assert C.broadcast(t, src=src) is t
            assert torch.equal(t, _data(seed, src, n, dtype, tag=300 + src)), (src, dtype, n)
    return True


def test_broadcast(cluster):
    assert cluster.run(_r_broadcast, SEED) == [True] * len(cluster._procs)


# ---------------------------------------------------------------------------------------------------------
# bad arguments: a clear error before any traffic, on every rank; then the group is still in step


def _r_bad_args(rank, P, seed):
    VE, TE = ValueError, TypeError
    f32 = torch.ones(8)
    i32 = torch.arange(8, dtype=torch.int32)
    C.reset_traffic()
    msgs = []
    e = msgs.append
    # gtopk
    e(_expect(VE, r"gtopk_allreduce: k must be >= 0, got -1", C.gtopk_allreduce, f32, i32, -1))
    e(_expect(TypeError, r"gtopk_allreduce: canonical must be a bool, got 1", C.gtopk_allreduce, f32, i32, 1,
              canonical=1))
    e(_expect(TE, r"k must be an int, got float", C.gtopk_allreduce, f32, i32, 2.0))
    e(_expect(TE, r"k must be an int, got bool", C.gtopk_allreduce, f32, i32, True))
    e(_expect(VE, r"`values` has 8 elements but `indices` has 7; they must match", C.gtopk_allreduce, f32,
              i32[:7].clone(), 2))
    e(_expect(VE, r"gtopk_allreduce: `indices` must be int32, got Long", C.gtopk_allreduce, f32, i32.long(), 2))
    e(_expect(VE, r"gtopk_allreduce: `values` must be contiguous", C.gtopk_allreduce, torch.ones(16)[::2], i32, 2))
    e(_expect(VE, r"gtopk_allreduce: `values` must be float32, float64, float16 or bfloat16, got Int",
              C.gtopk_allreduce, i32, i32, 2))
    e(_expect(VE, r"gtopk_allreduce: index -5 at position 3 is out of range", C.gtopk_allreduce, f32,
              torch.tensor([0, 1, 2, -5, 4, 5, 6, 7], dtype=torch.int32), 2))
    e(_expect(TE, r"must be a torch.Tensor, got list", C.gtopk_allreduce, [1.0], i32, 2))
    e(_expect(VE, r"value_bits must be None \(the values' dtype\) or 4, got 8", C.gtopk_allreduce, f32, i32, 2,
              value_bits=8))
    e(_expect(VE, r"numel must be an int >= 0 or None, got -3", C.gtopk_allreduce, f32, i32, 2, numel=-3))
    e(_expect(VE, r"gtopk_allreduce: index 7 at position 7 is out of range \[0, 7\)", C.gtopk_allreduce, f32, i32, 2,
              numel=7))
    e(_expect(VE, r"exact=True sums the ranks' exact values, so it cannot be combined with value_bits=4",
              C.gtopk_allreduce, f32, i32, 2, exact=True, value_bits=4))
    e(_expect(VE, r"value_bits=4 needs distinct indices; 2 of the 8 are repeats", C.gtopk_allreduce, f32,
              torch.tensor([0, 1, 1, 3, 4, 4, 6, 7], dtype=torch.int32), 2, value_bits=4))
    # sparse_allreduce
    e(_expect(VE, r"sparse_allreduce: `values` has 8 elements but `indices` has 3", C.sparse_allreduce, f32,
              i32[:3].clone(), 100))
    e(_expect(VE, r"sparse_allreduce: `indices` must be int32, got Long", C.sparse_allreduce, f32, i32.long(), 100))
    e(_expect(VE, r"sparse_allreduce: `indices` must be contiguous", C.sparse_allreduce, f32[:4],
              torch.arange(8, dtype=torch.int32)[::2], 100))
    e(_expect(VE, r"sparse_allreduce: index 7 at position 7 is out of range \[0, 7\)", C.sparse_allreduce, f32,
              i32, 7))
    e(_expect(VE, r"sparse_allreduce: index -1 at position 0 is out of range", C.sparse_allreduce, f32[:1],
              torch.tensor([-1], dtype=torch.int32), 7))
    e(_expect(VE, r"sparse_allreduce: numel must be >= 0, got -3", C.sparse_allreduce, f32, i32, -3))
    e(_expect(VE, r"sparse_allgather: `values` has 8 elements but `indices` has 3", C.sparse_allgather, f32,
              i32[:3]))
    e(_expect(VE, r"sparse_allgather: index -1 at position 0 is out of range", C.sparse_allgather, f32[:1],
              torch.tensor([-1], dtype=torch.int32)))
    e(_expect(VE, r"sparse_allgather: k=3 but this rank \(\d+\) passes 8 values; with k given, every rank sends "
                  r"exactly k pairs", C.sparse_allgather, f32, i32, k=3))
    e(_expect(VE, r"sparse_allgather: k must be an int >= 0 or None, got -1", C.sparse_allgather, f32, i32, k=-1))
    e(_expect(TE, r"sparse_allreduce: numel must be an int, got float", C.sparse_allreduce, f32, i32, 8.0))
    # allreduce / compressed / peer / broadcast
    e(_expect(VE, r"allreduce: op='max' is not allowed; choose one of 'avg', 'sum'", C.allreduce, f32, op="max"))
    e(_expect(VE, r"allreduce: `t` must be contiguous", C.allreduce, torch.ones(4, 4).t()))
    e(_expect(VE, r"allreduce\(op='avg'\): `t` must be float32, float64, float16 or bfloat16, got Long",
              C.allreduce, torch.ones(3, dtype=torch.long)))
    e(_expect(TE, r"allreduce: `t` must be a torch.Tensor, got ndarray", C.allreduce, np.ones(3)))
    # .* between the built-ins: compressors other tests registered in these long-lived workers are listed too
    e(_expect(VE, r"unknown compression 'int4'; choose one of 'none', .*'bf16', 'fp16', .*'minmax_uint8', .*'sign'",
              C.compressed_allreduce, f32, "int4"))
    e(_expect(VE, r"compressed_allreduce: op='mean' is not allowed", C.compressed_allreduce, f32, "fp16",
              op="mean"))
    e(_expect(VE, r"compressed_allreduce: `t` must be contiguous", C.compressed_allreduce, torch.ones(16)[::2]))
    e(_expect(VE, r"compressed_allreduce: `t` must be float32.*got Int", C.compressed_allreduce,
              torch.ones(4, dtype=torch.int32)))
    e(_expect(VE, r"broadcast: `t` must be contiguous", C.broadcast, torch.ones(16)[::2], 0))
    e(_expect(VE, rf"broadcast: src must be a rank of the group in \[0, {P}\), got {P}", C.broadcast, f32, P))
    e(_expect(VE, r"broadcast: src must be a rank of the group in .*got -1", C.broadcast, f32, -1))
    e(_expect(TE, r"group must be a torch.distributed ProcessGroup or None, got str", C.allreduce, f32,
              group="world"))
    assert C.bytes_sent() == 0 and C.messages_sent() == 0, "a rejected call put traffic on the wire"

    # A group that excludes this rank (new_group must be entered by every rank).
    if P >= 2:
        g = dist.new_group(ranks=[0])
        if rank == 0:
            t = _data(seed, 0, 5)
            C.allreduce(t, op="sum", group=g)  # a one-rank group of its own: fine
            assert torch.equal(t, _data(seed, 0, 5))
        else:
            for fn, args in ((C.allreduce, (f32.clone(),)), (C.compressed_allreduce, (f32.clone(),)),
                             (C.sparse_allreduce, (f32, i32, 8)), (C.gtopk_allreduce, (f32, i32, 2)),
                             (C.broadcast, (f32.clone(),))):
                e(_expect(VE, rf"bagua_lite.comm.{fn.__name__}: rank {rank} is not a member of the given group",
                          fn, *args, group=g))
        assert C.bytes_sent() == 0
        # Arguments that disagree across ranks: every rank gets the same clear error, still in step.
        numel = 10 if rank == 0 else 11
        e(_expect(VE, r"sparse_allreduce: rank \d+ has numel=1[01] but rank \d+ has 1[01]; all ranks must pass the "
                      r"same numel", C.sparse_allreduce, torch.ones(2), torch.tensor([0, 9], dtype=torch.int32),
                  numel))
        dt = torch.float64 if rank == P - 1 else torch.float32
        e(_expect(VE, r"sparse_allreduce: rank .* sends values of dtype .* all ranks must use one dtype",
                  C.sparse_allreduce, torch.ones(2, dtype=dt), torch.tensor([0, 9], dtype=torch.int32), 10))

    # The group is still in step: a real collective right after gives the right answer.
    t = _data(seed, rank, 1000)
    C.allreduce(t, op="sum")
    ref = torch.stack([_data(seed, r, 1000) for r in range(P)]).sum(0)
    assert torch.allclose(t, ref, atol=1e-5)
    v, i = C.gtopk_allreduce(torch.tensor([float(rank + 1)]), torch.tensor([rank], dtype=torch.int32), P)
    assert i.tolist() == list(range(P)) and v.tolist() == [float(r + 1) for r in range(P)]
    return msgs


def test_bad_arguments_raise_before_traffic(cluster):
    res = cluster.run(_r_bad_args, SEED)
    assert all(len(m) >= 28 for m in res)


def test_not_initialized_in_process():
    assert not dist.is_initialized()
    t = torch.ones(4)
    i = torch.arange(4, dtype=torch.int32)
    calls = [(C.allreduce, (t,)), (C.compressed_allreduce, (t,)), (C.sparse_allreduce, (t, i, 4)),
             (C.gtopk_allreduce, (t, i, 2)), (C.broadcast, (t,))]
    for fn, args in calls:
        _expect(RuntimeError, rf"bagua_lite.comm.{fn.__name__}: torch.distributed is not initialized; call "
                              r"torch.distributed.init_process_group", fn, *args)
    assert torch.equal(t, torch.ones(4))


# ---------------------------------------------------------------------------------------------------------
# the engine: several buckets in flight, started in order, finished in order


def _r_engine(rank, P, seed):
    from bagua_lite._groups import resolve_group

    pg = resolve_group(None, "test")
    eng = _C.Engine()
    order = []

    def tagged(tag, fn):
        def op(flat):
            order.append(tag)
            fn(flat)
        op.__name__ = tag
        return op

    sizes = [1_000_003, 0, 4097, 300_001, 77]
    for step in range(2):  # the same engine serves step after step
        xs = [[_data(seed, r, n, tag=10 * step + i) for r in range(P)] for i, n in enumerate(sizes)]
        flats = [x[rank].clone() for x in xs]
        ops = [
            [_C.AllreduceOp(pg, True)],                                       # async, last op
            [_C.AllreduceOp(pg, True)],                                       # empty bucket
            [tagged("double", lambda f: f.mul_(2)), _C.AllreduceOp(pg, False)],  # sync op, then async sum
            [_C.AllreduceOp(pg, False), tagged("plus1", lambda f: f.add_(1))],    # async op followed by another
            [_C.CompressedAllreduceOp(pg, "fp16", True)],                     # synchronous native op
        ]
        eng.reset_stats()
        for i, (f, o) in enumerate(zip(flats, ops)):
            eng.submit(i, f, o)
        eng.wait_all()
        sums = [torch.stack(x).double().sum(0) for x in xs]
        refs = [sums[0] / P, sums[1], 2 * sums[2], sums[3] + 1, sums[4] / P]
        for i in range(4):
            assert torch.allclose(flats[i].double(), refs[i], rtol=1e-5, atol=1e-5 * P), (step, i)
        assert torch.allclose(flats[4].double(), refs[4], rtol=2e-3, atol=2e-3), step  # fp16 on the wire
        stats = eng.stats()
        assert stats["buckets_done"] == len(sizes) and stats["busy_seconds"] > 0, stats
    assert order == ["double", "plus1"] * 2, order

    # An op that fails on every rank: wait_all names the bucket and op; the bucket in flight before it
    # still completes, and the engine works again afterwards.
    def boom(flat):
        raise ValueError("boom")

    a = _data(seed, rank, 5000, tag=99)
    eng.submit(0, a, [_C.AllreduceOp(pg, False)])
    eng.submit(1, torch.ones(3), [boom])
    eng.submit(2, torch.ones(3), [tagged("after_error", lambda f: None)])
    _expect(RuntimeError, r"bucket 1, op boom failed: .*boom", eng.wait_all)
    assert "after_error" not in order  # after an error the queue drains without running ops
    assert torch.allclose(a.double(), torch.stack([_data(seed, r, 5000, tag=99) for r in range(P)]).double().sum(0),
                          rtol=1e-5, atol=1e-5 * P)
    b = torch.full((10,), float(rank))
    eng.submit(0, b, [_C.AllreduceOp(pg, False)])
    eng.wait_all()
    assert torch.equal(b, torch.full((10,), float(sum(range(P)))))
    eng.shutdown()
    return _sha(flats[0])


def test_engine_pipelines_buckets_in_order(cluster):
    res = cluster.run(_r_engine, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise after the engine's allreduce"


# ---------------------------------------------------------------------------------------------------------
# a failed peer gives an error, not a hang


def _r_die_or_collect(rank, P, victim, which):
    if rank == victim:
        os._exit(1)
    time.sleep(0.5)  # let the victim go first
    t0 = time.monotonic()
    try:
        if which == "allreduce":
            C.allreduce(torch.ones(1 << 18))
        elif which == "gtopk":
            C.gtopk_allreduce(torch.ones(4), torch.arange(4, dtype=torch.int32), 4)
        elif which == "engine":  # an allreduce in flight on the engine when the peer is gone
            from bagua_lite._groups import resolve_group
            eng = _C.Engine()
            eng.submit(0, torch.ones(1 << 18), [_C.AllreduceOp(resolve_group(None, "test"), True)])
            eng.wait_all()
    except Exception as ex:  # noqa: BLE001
        return ("raised", time.monotonic() - t0, f"{type(ex).__name__}: {ex}"[:300])
    return ("returned", time.monotonic() - t0, "")


@pytest.mark.parametrize("which", ["allreduce", "gtopk", "engine"])
def test_dead_peer_raises_instead_of_hanging(which):
    P, victim, pg_timeout = 3, 1, 5
    c = Cluster(P, timeout_s=pg_timeout)
    try:
        with pytest.raises(RemoteError) as info:
            c.run(_r_die_or_collect, victim, which, timeout=120, grace=pg_timeout + 15)
        err = info.value
        assert err.dead == [victim], str(err)
        survivors = {r: v for r, (ok, v) in err.partial.items() if ok}
        assert sorted(survivors) == [r for r in range(P) if r != victim], str(err)
        for r, (what, elapsed, msg) in survivors.items():
            assert what == "raised", (r, what, elapsed)
            # what ended the wait: the dead peer's connection, or the group's timeout (gloo names it in ms)
            ended = "by peer" in msg or f"Timed out waiting {pg_timeout * 1000}ms" in msg
            assert msg.startswith("RuntimeError: ") and ended, (r, msg)
            if which == "engine":
                assert "bagua_lite engine: bucket 0, op allreduce(avg) failed" in msg, (r, msg)
            print(f"{which}: rank {r} raised {elapsed:.2f} s after rank {victim} died (group timeout {pg_timeout} s)")
    finally:
        c.close()
