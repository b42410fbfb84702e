"""The compression axis: built-in codecs against numpy/torch references, error-feedback memory, and
compressed_allreduce with every built-in and with a user's Python compressor on real gloo groups
(P = 1, 2, 3, 4, 5, 8).
"""
import numpy as np
import pytest
import torch

import bagua_lite
from bagua_lite import comm as C
from bagua_lite import compressors
from bagua_lite import kernels as K

from test_comm import SEED, _chunks, _compressed_reference, _data, _sha

BUILTINS = ("fp16", "bf16", "minmax_uint8", "sign")


# ---------------------------------------------------------------------------------------------------------
# a user's compressor, written as the bagua_lite.compressors docstring shows (module level: the spawned
# ranks register it when they unpickle a task of this module)


@bagua_lite.register_compressor("absmax4_test")
class AbsMax4(bagua_lite.Compressor):
    error_feedback = True

    def wire_bytes(self, n):
        return 4 + n

    def compress(self, x, out):
        scale = float(x.abs().max()) / 7 if x.numel() else 0.0
        out[:4].view(torch.float32)[0] = scale
        codes = (x / scale).round() if scale > 0 else torch.zeros_like(x)
        out[4:].view(torch.int8).copy_(codes.clamp(-7, 7))

    def decompress(self, wire, out, accumulate=False):
        v = wire[4:].view(torch.int8).to(out.dtype) * wire[:4].view(torch.float32)[0]
        out.add_(v.view_as(out)) if accumulate else out.copy_(v.view_as(out))


class PythonWrapped(bagua_lite.Compressor):
    """A built-in called from Python (native=False): must give the native path's bits exactly."""

    def __init__(self, name):
        self.inner = compressors.get_compressor(name)
        self.name = f"py_{name}"

    def wire_bytes(self, n):
        return self.inner.wire_bytes(n)

    def compress(self, x, out):
        self.inner.compress(x, out)

    def decompress(self, wire, out, accumulate=False):
        self.inner.decompress(wire, out, accumulate)


def _roundtrip(x, name):
    return K.decompress(K.compress(x, name), name, x.numel(), x.dtype)


# ---------------------------------------------------------------------------------------------------------
# codecs, single process


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 65_537])
def test_builtin_codecs_against_references(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for name in BUILTINS:
        assert K.wire_bytes(name, n) == {"fp16": 2 * n, "bf16": 2 * n, "minmax_uint8": 8 + n,
                                         "sign": 4 + (n + 7) // 8}[name]
    assert torch.equal(_roundtrip(x, "fp16"), x.half().float())
    assert torch.equal(_roundtrip(x, "bf16"), x.bfloat16().float())
    wire = K.compress(x, "sign")
    scale = np.frombuffer(wire[:4].numpy().tobytes(), np.float32)[0]
    assert scale == pytest.approx(float(x.abs().mean()) if n else 0.0, rel=1e-6)
    bits = np.packbits((x.numpy() >= 0).astype(np.uint8), bitorder="little")
    assert np.array_equal(wire[4:].numpy(), bits)
    assert torch.equal(_roundtrip(x, "sign"), torch.where(x >= 0, scale, -scale).float())
    if n:
        step = float(x.max() - x.min()) / 255
        assert float((_roundtrip(x, "minmax_uint8") - x).abs().max()) <= step / 2 * 1.001


@pytest.mark.parametrize("n", [1, 7, 8, 9, 65_537, 300_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_builtin_decompress_accumulates(n, dtype):
    """decompress(accumulate=True) adds exactly the decoded values (float32 has its own fast loops)."""
    g = torch.Generator().manual_seed(n)
    x, base = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
    for name in BUILTINS:
        wire = K.compress(x, name)
        decoded = K.decompress(wire, name, n, dtype)
        out = base.clone()
        bagua_lite._C.decompress_into(wire, name, out, True)
        assert torch.equal(out, base + decoded), name


def _fixed_order_abs_sum(x):
    """kernels/sign_sum.h's summation of |x| in numpy float64: blocks of 2048 halved pairwise, then the block
    sums, zero-padded to a power of two, halved the same way (the CUDA kernel's order)."""
    a = np.abs(x.double().numpy())
    nb = -(-a.size // 2048)
    s = np.zeros(nb * 2048)
    s[:a.size] = a
    s = s.reshape(nb, 2048)
    while s.shape[1] > 1:
        h = s.shape[1] // 2
        s = s[:, :h] + s[:, h:]
    parts = s[:, 0]
    width = 1 << max(0, (nb - 1).bit_length())
    parts = np.concatenate([parts, np.zeros(width - nb)])
    while parts.size > 1:
        h = parts.size // 2
        parts = parts[:h] + parts[h:]
    return parts[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sign_scale_is_summed_in_the_documented_order(dtype):
    """The sign scale's bits are a function of the values alone, summed in the order the CUDA kernel
    follows, so CPU and GPU ranks write the same header (tests/gpu compares the two directly)."""
    for n in (1, 7, 2047, 2048, 2049, 65_537, 300_001):
        x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
        header = K.compress(x, "sign")[:4].numpy().view(np.float32)[0]
        assert header == np.float32(_fixed_order_abs_sum(x) / n), (dtype, n)


def test_minmax_header_writes_a_negative_zero_bound_as_positive_zero():
    """A -0 bound is written as +0, so the header bytes do not depend on the order a reduction meets zeros."""
    for x in (torch.tensor([-0.0, 1.0, 2.0]), torch.tensor([-1.0, -0.0]), torch.tensor([-0.0, -0.0])):
        lo, hi = K.compress(x, "minmax_uint8")[:8].numpy().view(np.float32)
        assert not np.signbit(lo) or lo != 0, x
        assert not np.signbit(hi) or hi != 0, x


def test_a_cpu_build_reports_no_cuda_kernels_and_refuses_their_entry_points():
    if K.cuda_kernels_enabled():
        pytest.skip("this build has the CUDA kernels (tests/gpu checks them)")
    assert not bagua_lite._C.cuda_handles_codec(torch.zeros(3))
    with pytest.raises(RuntimeError, match="no CUDA kernels"):
        bagua_lite._C.absmax_encode_cuda(torch.zeros(3), torch.zeros(4, dtype=torch.uint8),
                                         torch.zeros(2, dtype=torch.uint8), 4)


def test_fused_error_feedback_has_no_cpu_path_and_touches_nothing():
    """compress_with_residual is the CUDA kernels' fused path; on the CPU it declines and leaves every buffer
    as it was, so compressed_allreduce does the three steps itself."""
    x, r = torch.randn(1000), torch.randn(1000)
    for name in BUILTINS:
        wire = torch.full((K.wire_bytes(name, 1000),), 7, dtype=torch.uint8)
        x0, r0 = x.clone(), r.clone()
        assert bagua_lite._C.compress_with_residual(x0, name, r0, wire) is False
        assert torch.equal(x0, x) and torch.equal(r0, r) and bool((wire == 7).all())


def test_sign_rejects_non_finite_and_names_it():
    with pytest.raises(ValueError, match=r"sign compress: input must be finite"):
        K.compress(torch.tensor([1.0, float("inf")]), "sign")


def test_get_compressor_names_and_errors():
    assert compressors.get_compressor("none") is None
    assert compressors.get_compressor("sign").error_feedback and compressors.get_compressor("sign").native
    assert isinstance(compressors.get_compressor("absmax4_test"), AbsMax4)
    names = compressors.registered_compressors()
    assert names[0] == "none" and set(BUILTINS) | {"absmax4_test"} <= set(names)
    with pytest.raises(ValueError, match=r"unknown compression 'int3'; choose one of 'none', .*'sign'"):
        compressors.get_compressor("int3")
    with pytest.raises(TypeError, match=r"is not a subclass of bagua_lite.Compressor"):
        bagua_lite.register_compressor("x_test")(object)
    with pytest.raises(ValueError, match=r"already registered"):
        bagua_lite.register_compressor("absmax4_test")(PythonWrapped)
    with pytest.raises(ValueError, match=r"other than 'none'"):
        bagua_lite.register_compressor("none")


@pytest.mark.parametrize("name", BUILTINS + ("absmax4_test",))
def test_encode_keeps_what_compression_lost(name):
    """Error feedback: residual' = (x + residual) - D(C(x + residual)), and over steps nothing is lost:
    sum of what receivers decoded + final residual == sum of inputs."""
    comp = compressors.get_compressor(name)
    g = torch.Generator().manual_seed(3)
    residual = torch.zeros(1001)
    sent_total, input_total = torch.zeros(1001, dtype=torch.float64), torch.zeros(1001, dtype=torch.float64)
    wire = torch.empty(comp.wire_bytes(1001), dtype=torch.uint8)
    for _ in range(5):
        x = torch.randn(1001, generator=g)
        input_total += x.double()
        expected_acc = x + residual
        compressors.encode(comp, x, wire, residual)
        assert torch.equal(x, expected_acc)  # x now holds what was meant to be sent
        decoded = torch.empty(1001)
        comp.decompress(wire, decoded)
        assert torch.equal(residual, expected_acc - decoded)
        sent_total += decoded.double()
    assert torch.allclose(sent_total + residual.double(), input_total, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# compressed_allreduce on real groups


def _r_compressed_all(rank, P, seed):
    out = {}
    for n in sorted({0, 1, P + 1, 1000, 4099}):
        xs = [_data(seed, r, n, tag=n + 5) * (r + 1) for r in range(P)]
        for name in ("bf16", "sign", "absmax4_test"):
            t = xs[rank].clone()
            C.compressed_allreduce(t, name)
            if P == 1:
                assert torch.equal(t, xs[0]), name
            elif name in ("bf16", "sign"):
                ref, _ = _compressed_reference(xs, name, True)
                assert torch.equal(t, ref), (name, n)
            out[(name, n)] = _sha(t)
        if P > 1 and n:
            # bf16 is close to the true average; the user's 4-bit codec within its quantization step
            true = torch.stack(xs).double().mean(0)
            t = xs[rank].clone()
            C.compressed_allreduce(t, "bf16")
            assert float((t.double() - true).abs().max()) < 0.05 * float(true.abs().max()) + 1e-6
            t = xs[rank].clone()
            C.compressed_allreduce(t, "absmax4_test")
            step = max(float(x.abs().max()) for x in xs) / 7
            assert float((t.double() - true).abs().max()) <= step * 1.01 + float(true.abs().max()) / 7 * 1.01
        # the generic Python path gives the native path's bits
        for name in ("fp16", "minmax_uint8", "sign"):
            a, b = xs[rank].clone(), xs[rank].clone()
            C.compressed_allreduce(a, name)
            C.compressed_allreduce(b, PythonWrapped(name))
            assert torch.equal(a, b), (name, n)
            ra, rb = torch.full_like(a, 0.25), torch.full_like(a, 0.25)
            a, b = xs[rank].clone(), xs[rank].clone()
            C.compressed_allreduce(a, name, residual=ra)
            C.compressed_allreduce(b, PythonWrapped(name), residual=rb)
            assert torch.equal(a, b) and torch.equal(ra, rb), (name, n, "residual")
    return out


def _r_residual(rank, P, seed):
    """With a residual each rank's chunks carry x + residual, and the residual keeps exactly what each
    chunk's compression lost (chunk by chunk, as the collective splits the tensor)."""
    out = {}
    for name in BUILTINS:
        n = 5003
        x = _data(seed, rank, n, tag=77)
        residual = _data(seed, rank, n, tag=78) * 0.01
        acc = x + residual
        expected = torch.empty(n)
        if P == 1:
            expected.copy_(residual)
        else:
            for b, ln in _chunks(n, P):
                piece = acc[b:b + ln].contiguous()
                expected[b:b + ln] = piece - _roundtrip(piece, name)
        t = x.clone()
        C.compressed_allreduce(t, name, residual=residual)
        assert torch.equal(residual, expected), name
        out[name] = _sha(t)
    return out


def test_compressed_allreduce_every_compressor(cluster):
    res = cluster.run(_r_compressed_all, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise"


def test_compressed_allreduce_error_feedback(cluster):
    res = cluster.run(_r_residual, SEED)
    assert all(r == res[0] for r in res), "ranks differ bitwise"


def _r_bad_residual(rank, P):
    with pytest.raises(ValueError, match=r"residual must be a contiguous tensor of t's shape \(8,\)"):
        C.compressed_allreduce(torch.ones(8), "fp16", residual=torch.zeros(7))
    return True


def test_bad_residual_raises_before_traffic(clusters):
    assert all(clusters.get(2).run(_r_bad_residual))


def test_readme_compressor_example_works_as_written(tmp_path):
    """The README's compressor, run as a user would: exec'd after a plain ``import bagua_lite`` in a fresh
    interpreter, then selected by name in YAML and used by the generic collective path (one rank)."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    section = readme[readme.index("### Compressors"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = code + '''
import datetime, torch.distributed as dist
from bagua_lite import compressors
c = compressors.get_compressor("int4")
x = torch.randn(1001)
wire = torch.empty(c.wire_bytes(x.numel()), dtype=torch.uint8)
c.compress(x, wire)
y = torch.empty_like(x)
c.decompress(wire, y)
assert float((x - y).abs().max()) <= float(x.abs().max()) / 7 / 2 * 1.001
cfg = bagua_lite.parse_config("algorithm:\\n  name: gradient_allreduce\\n  compression: int4\\n")
assert cfg.algorithm.compressor is c or type(cfg.algorithm.compressor).__name__ == "Int4"
dist.init_process_group("gloo", init_method="file://''' + str(tmp_path / "pg") + '''", rank=0, world_size=1)
t = x.clone()
bagua_lite.comm.compressed_allreduce(t, "int4")
assert torch.equal(t, x)
print("ok")
'''
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


@pytest.mark.parametrize("n, received", [(1, 1), (4095, 2), (4097, 2), (300_001, 3)])
def test_gossip_fold_matches_one_decompression_at_a_time(n, received):
    """decentralized's fused fold (minmax_uint8, float32) against decompress-then-add, step by step."""
    g = torch.Generator().manual_seed(n)
    wires = [K.compress(torch.randn(n, generator=g) * (j + 1), "minmax_uint8") for j in range(received + 1)]
    x_hat, nbr_sum = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ref_x, ref_n = x_hat.clone(), nbr_sum.clone()
    for w in wires[1:]:
        bagua_lite._C.decompress_into(w, "minmax_uint8", ref_n, True)
    bagua_lite._C.decompress_into(wires[0], "minmax_uint8", ref_x, True)
    delta = torch.empty(n)
    assert bagua_lite._C.gossip_fold("minmax_uint8", wires[0], wires[1:], x_hat, nbr_sum, delta, float(received))
    assert torch.equal(x_hat, ref_x) and torch.equal(nbr_sum, ref_n)
    assert torch.allclose(delta, ref_n - received * ref_x, rtol=0, atol=1e-5)
    # no fused path: says so and touches nothing
    before = x_hat.clone()
    assert not bagua_lite._C.gossip_fold("fp16", wires[0], wires[1:], x_hat, nbr_sum, delta, 1.0)
    assert not bagua_lite._C.gossip_fold("minmax_uint8", wires[0], wires[1:], x_hat.double(), nbr_sum, delta, 1.0)
    assert torch.equal(x_hat, before)


def test_python_builtins_of_the_diloco_family_are_registered():
    """absmax4/absmax2/topk* (tests/test_compressors_lowbit.py has their references): registered at import,
    written in Python (the generic collective path), all with error feedback."""
    names = compressors.registered_compressors()
    for name in ("absmax4", "absmax2", "topk1", "topk3", "topk10", "topk1_absmax2", "topk3_absmax2"):
        assert name in names, name
        comp = compressors.get_compressor(name)
        assert comp.name == name and comp.error_feedback and not comp.native, name
    assert "int4" not in names  # the README's example registers that name itself
