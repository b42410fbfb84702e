"""The Python built-in compressors of the DiLoCo family (SparseLoCo: diloco + top-k + 2-bit): ``absmax4``,
``absmax2`` and ``topk1``/``topk3``/``topk10`` against numpy references (wire bytes and decoded values,
exactly), error feedback through ``compressors.encode``, ``compressed_allreduce`` on real gloo groups at
P = 2 and 3 against a numpy re-implementation of the generic path, and diloco training with them."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bagua_lite
from bagua_lite import comm as C
from bagua_lite import compressors
from bagua_lite.algorithms import build

from test_comm import SEED, _chunks, _data, _sha

ABSMAX = {"absmax4": (4, 7), "absmax2": (2, 1)}  # name -> (bits, levels)
TOPK = {"topk1": 0.01, "topk3": 0.03, "topk10": 0.10}
TOPKQ = {"topk1_absmax2": 0.01, "topk3_absmax2": 0.03}  # top-k, values quantized as absmax2
NEW = tuple(ABSMAX) + tuple(TOPK) + tuple(TOPKQ)
SIZES = (0, 1, 2, 3, 4, 5, 7, 8, 9, 100, 1000, 4099)


# ---------------------------------------------------------------------------------------------------------
# numpy references (float32 throughout, as the compressors compute)


def _k(density, n):
    return 0 if n == 0 else min(n, max(1, round(density * n)))


def _ref_wire_bytes(name, n):
    if name in ABSMAX:
        per = 8 // ABSMAX[name][0]
        return 4 + (n + per - 1) // per
    if name in TOPKQ:
        k = _k(TOPKQ[name], n)
        return 4 + 4 * k + (k + 3) // 4
    return 8 * _k(TOPK[name], n)


def _ref_absmax(x, bits, levels):
    """(scale, float32 codes, packed bytes) of absmax quantization of float32 numpy ``x``."""
    n = x.size
    scale = (np.abs(x).max() / np.float32(levels)).astype(np.float32) if n else np.float32(0)
    codes = np.clip(np.round(x / scale), -levels, levels) if scale > 0 else np.zeros(n, np.float32)
    per = 8 // bits
    u = np.zeros((n + per - 1) // per * per, np.uint8)
    u[:n] = (codes + levels).astype(np.uint8)
    packed = np.zeros(len(u) // per, np.uint8)
    for j in range(per):
        packed |= (u[j::per] << (bits * j)).astype(np.uint8)
    return np.float32(scale), codes.astype(np.float32), packed


def _ref_encode(name, x):
    """(wire bytes, decoded float32 values) of float32 numpy ``x``."""
    x = np.asarray(x, np.float32)
    n = x.size
    if name in ABSMAX:
        scale, codes, packed = _ref_absmax(x, *ABSMAX[name])
        wire = np.frombuffer(scale.tobytes() + packed.tobytes(), np.uint8)
        return wire, (codes * scale).astype(np.float32)
    k = _k({**TOPK, **TOPKQ}[name], n)
    idx = np.sort(np.argsort(-np.abs(x), kind="stable")[:k]).astype(np.int32)
    vals = x[idx].astype(np.float32)
    decoded = np.zeros(n, np.float32)
    if name in TOPKQ:
        scale, codes, packed = _ref_absmax(vals, 2, 1)
        wire = np.frombuffer(scale.tobytes() + idx.tobytes() + packed.tobytes(), np.uint8)
        decoded[idx] = (codes * scale).astype(np.float32)
    else:
        wire = np.frombuffer(vals.tobytes() + idx.tobytes(), np.uint8)
        decoded[idx] = vals
    return wire, decoded


def _bound(name, x):
    """Largest error of one compression of ``x`` (absmax: half a step; top-k: the largest dropped |x|)."""
    x = np.abs(np.asarray(x, np.float64))
    if not x.size:
        return 0.0
    if name in ABSMAX:
        return x.max() / ABSMAX[name][1] / 2 * 1.0001
    k = _k({**TOPK, **TOPKQ}[name], x.size)
    dropped = np.sort(x)[::-1][k] if k < x.size else 0.0
    return max(dropped, x.max() / 2 * 1.0001) if name in TOPKQ else dropped


def _codec(name, x):
    comp = compressors.get_compressor(name)
    wire = torch.full((comp.wire_bytes(x.numel()),), 0xAB, dtype=torch.uint8)
    comp.compress(x, wire)
    out = torch.empty(x.numel(), dtype=torch.float32)
    comp.decompress(wire, out)
    return wire, out


# ---------------------------------------------------------------------------------------------------------
# single process


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("n", SIZES)
def test_wire_and_decoded_values_match_numpy_reference(name, n):
    comp = compressors.get_compressor(name)
    assert comp.error_feedback and not comp.native and comp.name == name
    assert comp.wire_bytes(n) == _ref_wire_bytes(name, n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + 17)) * 3
    if n > 4:
        x[1] = 0.0  # exact zeros and a value at exactly half a step
        if name in ABSMAX:
            x[3] = float(x.abs().max()) / ABSMAX[name][1] * 0.5
    ref_wire, ref_dec = _ref_encode(name, x.numpy())
    wire, out = _codec(name, x)
    assert np.array_equal(wire.numpy(), ref_wire), (name, n)  # compress writes exactly wire_bytes(n) bytes
    assert np.array_equal(out.numpy(), ref_dec), (name, n)
    if n:
        assert float((out - x).abs().max()) <= _bound(name, x.numpy()) + 1e-7


def test_absmax_codes_and_topk_by_hand():
    x = torch.tensor([1.0, -0.5, 0.26, -0.2, 0.0])
    _, dec4 = _codec("absmax4", x)
    s = np.float32(1.0) / np.float32(7)  # float32(1/7) is a little above 1/7: -0.5 / s = -3.4999998 -> -3
    assert np.array_equal(dec4.numpy(), (np.array([7, -3, 2, -1, 0], np.float32) * s).astype(np.float32))
    wire2, dec2 = _codec("absmax2", x)
    assert dec2.tolist() == [1.0, -0.0, 0.0, 0.0, 0.0]  # -0.5 rounds half to even: 0
    assert wire2[4:].tolist() == [2 | 1 << 2 | 1 << 4 | 1 << 6, 1]  # biased codes 2,1,1,1 | 1 (+ zero padding)
    wire, dec = _codec("topk10", torch.tensor([0.1, -5.0, 0.3, 2.0] + [0.0] * 16))
    assert dec.tolist() == [0.0, -5.0, 0.0, 2.0] + [0.0] * 16
    assert wire[8:].view(torch.int32).tolist() == [1, 3] and wire[:8].view(torch.float32).tolist() == [-5.0, 2.0]
    c = compressors.TopKAbsMax2Compressor(0.1)  # k = 2: values -5, 2 -> scale 5, codes -1, round(0.4) = 0
    wire = torch.empty(c.wire_bytes(20), dtype=torch.uint8)
    assert wire.numel() == 4 + 8 + 1
    c.compress(torch.tensor([0.1, -5.0, 0.3, 2.0] + [0.0] * 16), wire)
    assert wire[:4].view(torch.float32).item() == 5.0 and wire[4:12].view(torch.int32).tolist() == [1, 3]
    assert wire[12:].tolist() == [0 | 1 << 2]
    dec = torch.ones(20)
    c.decompress(wire, dec)
    assert dec.tolist() == [0.0, -5.0] + [0.0] * 18


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("n", (1, 5, 1001))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.float16, torch.bfloat16))
def test_decompress_accumulates_and_other_dtypes_compute_in_float32(name, n, dtype):
    comp = compressors.get_compressor(name)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype)
    wire = torch.empty(comp.wire_bytes(n), dtype=torch.uint8)
    comp.compress(x, wire)
    ref_wire, ref_dec = _ref_encode(name, x.float().numpy())
    assert np.array_equal(wire.numpy(), ref_wire)
    decoded = torch.empty(n, dtype=dtype)
    comp.decompress(wire, decoded)
    assert torch.equal(decoded, torch.from_numpy(ref_dec).to(dtype))
    base = torch.randn(n, generator=g).to(dtype)
    out = base.clone()
    comp.decompress(wire, out, accumulate=True)
    assert torch.equal(out, base + decoded), (name, n, dtype)
    two_d = base.clone().view(1, n)  # any contiguous shape
    comp.decompress(wire, two_d, accumulate=True)
    assert torch.equal(two_d.view(-1), out)


@pytest.mark.parametrize("name", tuple(TOPK) + tuple(TOPKQ))
def test_topk_ties_go_to_the_lower_index(name):
    x = torch.tensor([1.0, -2.0, 2.0, 0.5] * 50 + [-2.0] * 100)  # 200 magnitudes of 2 for k = 3, 9 or 30
    ref_wire, ref_dec = _ref_encode(name, x.numpy())
    wire, dec = _codec(name, x)
    assert np.array_equal(wire.numpy(), ref_wire) and np.array_equal(dec.numpy(), ref_dec)
    k = _k({**TOPK, **TOPKQ}[name], 300)
    assert dec.nonzero().view(-1).tolist() == sorted([4 * i + j for i in range(50) for j in (1, 2)])[:k]


@pytest.mark.parametrize("name", NEW)
def test_non_finite_inputs_do_not_crash(name):
    comp = compressors.get_compressor(name)
    for x in (torch.tensor([1.0, float("nan"), -2.0, 0.5]), torch.tensor([float("inf"), 1.0, -float("inf")]),
              torch.full((9,), float("nan"))):
        wire = torch.empty(comp.wire_bytes(x.numel()), dtype=torch.uint8)
        comp.compress(x, wire)
        out = torch.zeros(x.numel())
        comp.decompress(wire, out)
        comp.decompress(wire, out, accumulate=True)


def _aten_absmax(comp, x, base, accumulate):
    """The Python (ATen) codec, which other dtypes take: the reference for the float32 C++ kernel."""
    scale, codes = compressors._absmax_codes(x, comp.levels)
    wire = torch.zeros(comp.wire_bytes(x.numel()), dtype=torch.uint8)
    wire[:4].view(torch.float32)[0] = scale
    wire[4:].copy_(compressors._pack((codes + comp.levels).to(torch.uint8), comp.bits))
    out = base.clone()
    vals = compressors._unpack(wire[4:], comp.bits, x.numel()).to(torch.float32) - comp.levels
    compressors._deliver(vals * wire[:4].view(torch.float32)[0], out, accumulate)
    return wire, out


@pytest.mark.parametrize("name", tuple(ABSMAX))
def test_the_float32_kernel_is_the_aten_codec_bit_for_bit(name):
    """float32 CPU tensors take the C++ kernel (no temporaries; tests/test_allocations.py); it writes the ATen
    codec's bytes and decodes to its bits, on random and adversarial inputs (ties at .5, denormals, the
    largest floats, inf; NaN: the scale is a NaN either way and every code 0)."""
    comp = compressors.get_compressor(name)
    g = torch.Generator().manual_seed(SEED)
    xs = [torch.randn(n, generator=g) * 3 for n in SIZES + (65, 100_003)]
    xs += [torch.zeros(17), torch.full((10,), -2.5), torch.tensor([7.0, 3.5, -3.5, 0.5, -0.5, 1.5, 2.5, -6.5]),
           torch.tensor([1e-45, -1e-45, 3e-45, 0.0]), torch.tensor([3.4028235e38, -3.4028235e38, 1.0]),
           torch.tensor([1.0, float("inf"), -2.0]), torch.tensor([-float("inf"), 0.5]),
           torch.tensor([1.0, float("nan"), 3.0, -7.0, 0.25])]
    for x in xs:
        wire = torch.empty(comp.wire_bytes(x.numel()), dtype=torch.uint8)
        comp.compress(x, wire)
        for accumulate in (False, True):
            base = torch.randn(x.numel(), generator=g)
            ref_wire, ref_out = _aten_absmax(comp, x, base, accumulate)
            out = base.clone()
            comp.decompress(wire, out, accumulate=accumulate)
            if torch.isnan(x).any():  # the scale's NaN bits are not specified; the codes are
                assert wire[:4].view(torch.float32).isnan().all() and torch.equal(wire[4:], ref_wire[4:])
                assert out.isnan().all() and ref_out.isnan().all()
                continue
            assert torch.equal(wire, ref_wire), (name, x[:8])
            assert torch.equal(out.view(torch.int32), ref_out.view(torch.int32)), (name, accumulate, x[:8])


@pytest.mark.parametrize("name", NEW)
def test_encode_error_feedback_keeps_what_was_lost(name):
    """residual' = (x + residual) - D(C(x + residual)); over steps nothing is lost."""
    comp = compressors.get_compressor(name)
    g = torch.Generator().manual_seed(5)
    n = 1001
    residual = torch.zeros(n)
    sent_total, input_total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    wire = torch.empty(comp.wire_bytes(n), dtype=torch.uint8)
    for _ in range(6):
        x = torch.randn(n, generator=g)
        input_total += x.double()
        acc = x + residual
        compressors.encode(comp, x, wire, residual)
        assert torch.equal(x, acc)
        decoded = torch.empty(n)
        comp.decompress(wire, decoded)
        assert torch.equal(decoded, torch.from_numpy(_ref_encode(name, acc.numpy())[1]))
        assert torch.equal(residual, acc - decoded)
        sent_total += decoded.double()
    assert float(residual.abs().max()) > 0
    assert torch.allclose(sent_total + residual.double(), input_total, atol=1e-4)


def test_topk_compressor_class_and_registry():
    names = compressors.registered_compressors()
    assert set(NEW) <= set(names) and "int4" not in names
    c = compressors.TopKCompressor(0.25)
    assert [c.k(n) for n in (0, 1, 2, 3, 4, 10, 14)] == [0, 1, 1, 1, 1, 2, 4]  # round(3.5) = 4, round(2.5) = 2
    assert compressors.get_compressor("topk3").density == 0.03
    assert isinstance(compressors.get_compressor("topk1"), compressors.TopKCompressor)
    assert isinstance(compressors.get_compressor("topk3_absmax2"), compressors.TopKAbsMax2Compressor)
    assert compressors.get_compressor("topk1_absmax2").density == 0.01
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got 0.0"):
        compressors.TopKCompressor(0.0)
    with pytest.raises(ValueError, match="density"):
        compressors.TopKCompressor.of(1.5)
    cfg = bagua_lite.parse_config("algorithm:\n  name: diloco\n  period: 5\n  compression: topk3\n")
    assert cfg.algorithm.name == "diloco"


# ---------------------------------------------------------------------------------------------------------
# compressed_allreduce on real groups


def _ref_allreduce(name, xs, residuals):
    """numpy re-implementation of comm._compressed_allreduce_py with error feedback (average):
    returns (result, every rank's new residual)."""
    P, n = len(xs), xs[0].size
    out = np.empty(n, np.float32)
    new_res = [np.empty(n, np.float32) for _ in range(P)]
    for b, ln in _chunks(n, P):
        acc = None
        for r in range(P):
            piece = (xs[r][b:b + ln] + residuals[r][b:b + ln]).astype(np.float32)
            dec = _ref_encode(name, piece)[1]
            new_res[r][b:b + ln] = piece - dec
            acc = dec.copy() if acc is None else (acc + dec).astype(np.float32)
        acc = (acc / np.float32(P)).astype(np.float32)
        out[b:b + ln] = _ref_encode(name, acc)[1]
    return out, new_res


def _r_lowbit_allreduce(rank, P, seed):
    out = {}
    for n in sorted({0, 1, P + 1, 1000, 4099}):
        xs = [_data(seed, r, n, tag=n + 11) * (r + 1) for r in range(P)]
        rs = [_data(seed, r, n, tag=n + 12) * 0.05 for r in range(P)]
        true = torch.stack(xs).double().mean(0) if n else torch.zeros(0, dtype=torch.float64)
        for name in NEW:
            t, res = xs[rank].clone(), rs[rank].clone()
            assert C.compressed_allreduce(t, name, residual=res) is t
            ref, ref_res = _ref_allreduce(name, [x.numpy() for x in xs], [r.numpy() for r in rs])
            assert np.array_equal(t.numpy(), ref), (name, n, P)
            assert np.array_equal(res.numpy(), ref_res[rank]), (name, n, P, "residual")
            if n and name in ABSMAX:
                # error: the residual-carrying inputs' quantization (averaged) plus the recompression
                sent = torch.stack([x + r for x, r in zip(xs, rs)]).double()
                err = float((t.double() - sent.mean(0)).abs().max())
                levels = ABSMAX[name][1]
                bound = (float(sent.abs().max()) / levels / 2 + float(sent.mean(0).abs().max()) / levels / 2)
                assert err <= bound * 1.01 + 1e-6, (name, n, err, bound)
                assert float((t.double() - true).abs().max()) <= bound * 1.01 + float(torch.stack(rs).abs().max())
            t2 = xs[rank].clone()
            C.compressed_allreduce(t2, name)  # no residual
            out[(name, n)] = (_sha(t), _sha(t2))
    return out


@pytest.mark.parametrize("P", (2, 3), ids=lambda p: f"P{p}")
def test_compressed_allreduce_lowbit_matches_reference_on_every_rank(clusters, P):
    res = clusters.get(P).run(_r_lowbit_allreduce, SEED, timeout=180)
    assert all(r == res[0] for r in res), "ranks differ bitwise"


# ---------------------------------------------------------------------------------------------------------
# diloco with the new compressors (SparseLoCo-style)


def _r_diloco(rank, P, compression, H, syncs):
    from test_diloco import _batch, _flat, _inner, _net

    net = _net()
    opt = _inner(net)
    model = bagua_lite.DistributedModel(net, opt, build("diloco", period=H, compression=compression),
                                        bucket_size_mb=0.001)
    start = _flat(net).clone()
    identical_after_sync, differ_between = [], []
    for s in range(H * syncs):
        x, y = _batch(rank, s)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        mine = _flat(net)
        everyone = [torch.empty_like(mine) for _ in range(P)]
        torch.distributed.all_gather(everyone, mine)
        same = all(torch.equal(everyone[0], e) for e in everyone)
        (identical_after_sync if (s + 1) % H == 0 else differ_between).append(same)
    state = model.algorithm.state_dict()
    model.close()
    residual = float(sum(r.abs().sum() for r in state["fragments"][0]["averager"]["residuals"]))
    moved = float((_flat(net) - start).abs().max())
    finite = bool(torch.isfinite(_flat(net)).all())
    return identical_after_sync, differ_between, residual, moved, finite


@pytest.mark.parametrize("compression", ("absmax2", "topk3"))
def test_diloco_with_lowbit_compression_keeps_replicas_identical(clusters, compression):
    H, syncs = 3, 3
    for r, (after, between, residual, moved, finite) in enumerate(
            clusters.get(3).run(_r_diloco, compression, H, syncs, timeout=180)):
        assert after == [True] * syncs, (compression, r, after)
        assert not any(between), (compression, r, between)  # replicas drift between syncs (different data)
        assert residual > 0 and moved > 0 and finite, (compression, r, residual, moved)
