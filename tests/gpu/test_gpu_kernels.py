"""Every kernel and codec on the device against its CPU version, on fresh random inputs: bit for bit
(codecs: the same wire bytes, so CPU and GPU ranks could interoperate and checkpoints stay portable)."""
import pytest
import torch

from bagua_lite import _C, compressors
from bagua_lite import kernels as K

SIZES = [0, 1, 7, 1000, 65537, (1 << 20) + 3]
NATIVE = ["fp16", "bf16", "minmax_uint8", "sign"]
PYTHON = ["absmax4", "absmax2", "topk1", "topk3_absmax2"]


def _x(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 3).to(dtype)


def _diff(a, b):
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype == torch.uint8:
        return float((a.int() - b.int()).abs().max()) if a.numel() else 0.0
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk(dev, record, dtype):
    worst, ok = 0.0, True
    for n in SIZES[1:]:
        for k in sorted({1, max(1, n // 1000), max(1, n // 100), n}):
            x = _x(n, n + k, dtype)
            cv, ci = K.topk(x, k)
            dv, di = K.topk(x.to(dev), k)
            same = torch.equal(cv, dv.cpu()) and torch.equal(ci, di.cpu())
            ok &= same and dv.device == dev and dv.numel() == k
            worst = max(worst, _diff(cv, dv))
    for name, x in [("all equal", torch.full((5000,), 0.5)), ("ties", torch.tensor([1.0, -1.0] * 3000)),
                    ("one huge", torch.cat([torch.zeros(9999), torch.tensor([3e38])])),
                    ("denormals", torch.full((4096,), 1e-44))]:
        cv, ci = K.topk(x, 17)
        dv, di = K.topk(x.to(dev), 17)
        ok &= torch.equal(cv, dv.cpu()) and torch.equal(ci, di.cpu())
    record(f"kernel topk {str(dtype)[6:]}", "-", 1, ok, worst)
    assert ok


def _adversarial(n):
    """Inputs that defeat a sampled threshold (the kernel must fall back on the device and stay exact)."""
    g = torch.Generator().manual_seed(n)
    periodic = torch.rand(n, generator=g) * 1e-3
    periodic[::max(1, n // 8192)] = 5.0  # large exactly where an evenly spaced sample looks
    return [("all equal", torch.full((n,), 0.5)), ("ties +-1", torch.tensor([1.0, -1.0]).repeat(n // 2)),
            ("one huge", torch.cat([torch.zeros(n - 1), torch.tensor([3e38])])),
            ("denormals", torch.full((n,), 1e-44)), ("zeros and -0", torch.tensor([0.0, -0.0]).repeat(n // 2)),
            ("sorted", torch.randn(n, generator=g).abs().sort().values), ("sample aliasing", periodic),
            ("inf", torch.cat([torch.randn(n - 3, generator=g), torch.tensor([float("inf"), -float("inf"), 1.0])]))]


@pytest.mark.parametrize("n", [40000, 1 << 20])
def test_topk_adversarial_large(dev, record, n):
    """Sizes where the device kernel samples a threshold (above 32768 elements), with the inputs that make
    the sample misjudge, at k = 1, a few, density 0.001 / 0.01 / 0.3 and n - 1."""
    ok, bad = True, []
    for name, x in _adversarial(n):
        for k in sorted({1, 17, max(1, n // 1000), n // 100, 3 * n // 10, x.numel() - 1}):
            cv, ci = K.topk(x, k)
            dv, di = K.topk(x.to(dev), k)
            same = torch.equal(cv, dv.cpu()) and torch.equal(ci, di.cpu())
            ok &= same
            if not same:
                bad.append(f"{name} k={k}")
    record(f"kernel topk adversarial n={n}", "-", 1, ok, 0.0 if ok else float("nan"), note=", ".join(bad[:4]))
    assert ok, bad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NATIVE + ["absmax4", "absmax2"])
def test_codec_half_inputs(dev, record, name, dtype):
    """Encoding float16 / bfloat16 values: the wire bytes the CPU writes for them; decoding into them."""
    comp = compressors.get_compressor(name)
    ok = True
    for n in SIZES:
        x = _x(n, 7 * n + 3, dtype)
        wire_c = torch.empty(comp.wire_bytes(n), dtype=torch.uint8)
        wire_d = torch.empty(comp.wire_bytes(n), dtype=torch.uint8, device=dev)
        comp.compress(x, wire_c)
        comp.compress(x.to(dev), wire_d)
        ok &= torch.equal(wire_c, wire_d.cpu())
        for accumulate in (False, True):
            out_c, out_d = x.clone(), x.to(dev)
            comp.decompress(wire_c, out_c, accumulate=accumulate)
            comp.decompress(wire_c.to(dev), out_d, accumulate=accumulate)
            ok &= torch.equal(out_c, out_d.cpu())
    record(f"codec {name} {str(dtype)[6:]}", "-", 1, ok, 0.0 if ok else float("nan"))
    assert ok


@pytest.mark.parametrize("name", NATIVE)
def test_fused_error_feedback_equals_the_three_steps_on_the_cpu(dev, record, name):
    """compress_with_residual on the device (x += r; wire = C(x); r = x - D(wire), fused) against the three
    steps on the CPU: the same wire bytes, residual and x."""
    if dev.type == "cpu":
        record(f"fused error feedback {name}", "-", 1, True, 0.0, note="no fused path on the CPU")
        return
    comp = compressors.get_compressor(name)
    ok, worst = True, 0.0
    for n in SIZES:
        x, r = _x(n, 13 * n + 1), _x(n, 17 * n + 2) * 0.1
        wire_c = torch.empty(comp.wire_bytes(n), dtype=torch.uint8)
        x_c, r_c = x.clone(), r.clone()
        x_c.add_(r_c)
        comp.compress(x_c, wire_c)
        comp.decompress(wire_c, r_c, accumulate=False)
        torch.sub(x_c, r_c, out=r_c)
        x_d, r_d = x.to(dev), r.to(dev)
        wire_d = torch.empty(comp.wire_bytes(n), dtype=torch.uint8, device=dev)
        ok &= _C.compress_with_residual(x_d, name, r_d, wire_d)
        ok &= torch.equal(wire_c, wire_d.cpu()) and torch.equal(r_c, r_d.cpu()) and torch.equal(x_c, x_d.cpu())
        worst = max(worst, _diff(r_c, r_d))
    record(f"fused error feedback {name}", "-", 1, ok, worst)
    assert ok


def test_kernels_never_wait_for_the_device(dev, record):
    """A top-k, scale_flagged_, scatter_add_, ef_remove_ or any built-in codec on CUDA tensors makes no device-to-host copy or
    synchronisation: torch's sync debug mode raises at the first one (the ATen fallbacks it replaces read
    values back)."""
    if dev.type == "cpu":
        record("no host synchronisation", "-", 1, True, 0.0, note="not applicable on the CPU")
        return
    x = _x((1 << 20) + 3, 5).to(dev)
    comps = [compressors.get_compressor(n) for n in NATIVE + PYTHON]
    wires = [torch.empty(c.wire_bytes(x.numel()), dtype=torch.uint8, device=dev) for c in comps]
    out = torch.empty_like(x)
    calls = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in (1, 1000, 10000, x.numel() // 3):
            K.topk(x, k)
            calls += 1
        for name in NATIVE:
            assert _C.compress_with_residual(x.clone(), name, torch.zeros_like(x),
                                             torch.empty(compressors.get_compressor(name).wire_bytes(x.numel()),
                                                         dtype=torch.uint8, device=dev))
            calls += 1
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        _C.scale_flagged_(out, x, 0.5, flag)
        _C.copy_flagged_(out, x, flag)  # the state a discarded round puts back (bagua_lite.verdict)
        calls += 1
        _C.add_flagged_(out, out, x, None, 0, flag)  # topk/gtopk's error feedback with the check deferred
        _C.momentum_add_flagged_(torch.empty_like(x), out.clone(), x, x, x, 0.9, x, 1e-4, None, 0, flag)
        calls += 3
        idx = torch.randint(0, x.numel(), (3000,), device=dev, dtype=torch.int32)
        K.scatter_add_(out, x[:3000], idx)
        K.ef_remove_(out, idx)
        K.ef_remove_(out, idx, kept=idx[:1000].sort().values.unique())  # gtopk's: only what the result kept
        calls += 3
        for comp, wire in zip(comps, wires):
            comp.compress(x, wire)
            comp.decompress(wire, out, accumulate=False)
            comp.decompress(wire, out, accumulate=True)
            calls += 3
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    record("no host synchronisation", "-", 1, True, 0.0, note=f"{calls} calls under set_sync_debug_mode('error')")


@pytest.mark.parametrize("name", NATIVE + PYTHON)
def test_codec_wire_bytes_and_decode(dev, record, name):
    comp = compressors.get_compressor(name)
    worst, ok = 0.0, True
    for n in SIZES:
        if n == 0 and name.startswith("topk"):
            continue
        x = _x(n, 11 * n + 1)
        wire_c = torch.empty(comp.wire_bytes(n), dtype=torch.uint8)
        wire_d = torch.empty(comp.wire_bytes(n), dtype=torch.uint8, device=dev)
        comp.compress(x, wire_c)
        comp.compress(x.to(dev), wire_d)
        ok &= torch.equal(wire_c, wire_d.cpu())
        worst = max(worst, _diff(wire_c, wire_d))
        for accumulate in (False, True):
            out_c, out_d = x.clone(), x.to(dev)
            comp.decompress(wire_c, out_c, accumulate=accumulate)
            comp.decompress(wire_c.to(dev), out_d, accumulate=accumulate)
            ok &= torch.equal(out_c, out_d.cpu())
            worst = max(worst, _diff(out_c, out_d))
    record(f"codec {name}", "-", 1, ok, worst, note="wire bytes and decode (+accumulate)")
    assert ok


def test_sparse_kernels(dev, record):
    """merge_topk, sparse_normalize, scatter_add_ (duplicate indices summed in order of j, as on the CPU) and
    ef_remove_ on the device against the CPU, one row each."""
    ok = {"merge_topk": True, "sparse_normalize": True, "scatter_add_": True, "ef_remove_": True}
    g = torch.Generator().manual_seed(3)
    for n in SIZES[2:]:
        k = max(1, n // 50)
        av, ai = K.topk(_x(n, 1), k)
        bv, bi = K.topk(_x(n, 2), k)
        merged_c = K.merge_topk(av, ai, bv, bi, k)
        merged_d = K.merge_topk(av.to(dev), ai.to(dev), bv.to(dev), bi.to(dev), k)
        ok["merge_topk"] &= all(torch.equal(c, d.cpu()) for c, d in zip(merged_c, merged_d))
        idx = torch.randint(0, n, (3 * k,), generator=g, dtype=torch.int32)
        vals = _x(3 * k, 4)
        norm_c = K.sparse_normalize(vals, idx)
        norm_d = K.sparse_normalize(vals.to(dev), idx.to(dev))
        ok["sparse_normalize"] &= all(torch.equal(c, d.cpu()) for c, d in zip(norm_c, norm_d))
        for dtype in (torch.float32, torch.bfloat16):
            dense_c, dense_d = _x(n, 5).to(dtype), _x(n, 5).to(dtype).to(dev)
            K.scatter_add_(dense_c, vals, idx)
            K.scatter_add_(dense_d, vals.to(dev), idx.to(dev))
            ok["scatter_add_"] &= torch.equal(dense_c, dense_d.cpu())
        K.ef_remove_(dense_c, ai)
        K.ef_remove_(dense_d, ai.to(dev))
        ok["ef_remove_"] &= torch.equal(dense_c, dense_d.cpu())
        K.ef_remove_(dense_c, bi, kept=merged_c[1])  # only the entries the merged set kept
        K.ef_remove_(dense_d, bi.to(dev), kept=merged_d[1])
        ok["ef_remove_"] &= torch.equal(dense_c, dense_d.cpu())
    for name, good in ok.items():
        record(f"kernel {name}", "-", 1, good, 0.0 if good else float("nan"))
    assert all(ok.values()), ok


def test_scale_flagged_on_the_device(dev, record):
    """The bucket fill whose non-finite answer stays on the device: slot bit for bit the CPU's, flag alike."""
    ok = True
    for n in SIZES[1:]:
        for where in (None, 0, n - 1):
            src = _x(n, 21)
            if where is not None:
                src[where] = float("inf")
            for same in (False, True):
                out_c = src.clone() if same else torch.full_like(src, 7.0)
                out_d = out_c.to(dev)
                src_d = out_d if same else src.to(dev)
                flag_c, flag_d = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32, device=dev)
                _C.scale_flagged_(out_c, out_c if same else src, 0.5, flag_c)
                _C.scale_flagged_(out_d, src_d, 0.5, flag_d)
                ok &= torch.equal(out_c.view(torch.int32), out_d.cpu().view(torch.int32))
                ok &= torch.equal(flag_c, flag_d.cpu())
    record("kernel scale_flagged_", "-", 1, ok, 0.0 if ok else float("nan"))
    assert ok


def test_copy_flagged_on_the_device(dev, record):
    """The state a discarded round puts back on the device: copied where a flag is set, untouched where none
    is, bit for bit as the CPU kernel, aligned or not, every float dtype."""
    ok = True
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in SIZES[1:]:
            src, dst = _x(n, 31).to(dtype), _x(n, 32).to(dtype)
            for flags in ([0, 0], [0, 1]):
                for off in (0, 1):  # 1: views not 16-byte aligned (the byte loop)
                    d_c, s_c = dst.clone()[off:], src[off:].contiguous()
                    d_d, s_d = dst.to(dev)[off:], src.to(dev)[off:].contiguous()
                    f_c = torch.tensor(flags, dtype=torch.int32)
                    _C.copy_flagged_(d_c, s_c, f_c)
                    _C.copy_flagged_(d_d, s_d, f_c.to(dev))
                    ok &= torch.equal(d_c.view(torch.uint8), d_d.cpu().view(torch.uint8))
    record("kernel copy_flagged_", "-", 1, ok, 0.0 if ok else float("nan"))
    assert ok


def test_error_feedback_flagged_on_the_device(dev, record):
    """topk/gtopk's error-feedback add whose non-finite answer stays on the device (add_flagged_,
    momentum_add_flagged_): outputs bit for bit the CPU's checked kernels' (a non-finite g left out), the
    flag set exactly where they return False."""
    ok = True
    for n in SIZES[1:]:
        for where in (None, 0, n - 1):
            g = _x(n, 23)
            if where is not None:
                g[where] = float("nan")
            a, u, w = _x(n, 24), _x(n, 25), _x(n, 26)
            want = torch.empty(n)
            good = _C.add_checked(want, a, g)
            got, flag = torch.empty(n, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
            _C.add_flagged_(got, a.to(dev), g.to(dev), None, 0, flag)
            ok &= torch.equal(want.view(torch.int32), got.cpu().view(torch.int32)) and int(flag) == (not good)
            for wd in (0.0, 1e-4):
                u_c, acc_c = torch.empty(n), torch.empty(n)
                good = _C.momentum_add_checked(u_c, acc_c, u, a, g, 0.9, w, wd)
                u_d, acc_d = torch.empty(n, device=dev), torch.empty(n, device=dev)
                flag = torch.zeros(1, dtype=torch.int32, device=dev)
                _C.momentum_add_flagged_(u_d, acc_d, u.to(dev), a.to(dev), g.to(dev), 0.9, w.to(dev), wd, None, 0, flag)
                # a device may fuse m u + g into one rounding where the CPU rounds twice: equal within an ulp
                ok &= torch.allclose(u_c, u_d.cpu(), rtol=1e-6, atol=1e-7) and torch.allclose(acc_c, acc_d.cpu(),
                                                                                              rtol=1e-6, atol=1e-7)
                ok &= int(flag) == (not good)
    record("kernel add_flagged_, momentum_add_flagged_", "-", 1, ok, 0.0 if ok else float("nan"))
    assert ok


def test_a_kernel_without_a_device_path_raises_naming_it(dev, record):
    """No input crashes the process: block maxima are a CPU-only aid, refused on another device by name."""
    x = _x(1000, 9).to(dev)
    v, i = torch.empty(5, device=dev), torch.empty(5, dtype=torch.int32, device=dev)
    bm = torch.zeros(16, dtype=torch.int32, device=dev)
    if dev.type == "cpu":
        record("device-only refusals", "-", 1, True, 0.0, note="not applicable on the CPU")
        return
    with pytest.raises((ValueError, RuntimeError), match="CPU"):
        _C.topk_out(x, 5, v, i, bm)
    record("device-only refusals", "-", 1, True, 0.0)
