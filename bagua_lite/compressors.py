"""The compression axis: what a dense tensor looks like on the wire.

A :class:`Compressor` turns ``n`` elements into ``wire_bytes(n)`` bytes (a uint8 tensor) and back. It
says *what to send*; *what to remember* -- error-feedback memory, the part compression lost, sent again
next time -- is kept by the framework (the collectives and algorithms take a ``residual`` buffer and
:func:`encode` updates it), so a compressor never holds state and works under every algorithm that
moves dense tensors: ``gradient_allreduce``, ``decentralized``, ``local_sgd``, ``async_model_average``,
``qadam``.

Built-ins (C++ fast paths, GIL released):

===================  ===============================================  ======================  ================
name                 wire format for n elements                       bytes                   error feedback
===================  ===============================================  ======================  ================
``fp16``             IEEE half                                        2n                      no
``bf16``             bfloat16 (float32's range: never overflows)      2n                      no
``minmax_uint8``     ``[min f32][max f32][n uint8]``                  8 + n                   no
``sign``             ``[mean abs f32][n bits]``                       4 + ceil(n/8)           yes
===================  ===============================================  ======================  ================

Built-ins written in Python (the generic collective path; for the DiLoCo family -- SparseLoCo is ``diloco``
with ``compression: topk3`` or ``absmax2`` -- but usable wherever the ones above are; codes are stored
biased, ``code + levels``, low bits first; k = min(n, max(1, round(density * n))), 0 for n = 0):

===================  =============================================  ====================  ================
name                 wire format for n elements                     bytes                 error feedback
===================  =============================================  ====================  ================
``absmax4``          ``[max|x|/7 f32][n 4-bit codes -7..7]``        4 + ceil(n/2)         yes
``absmax2``          ``[max|x| f32][n 2-bit codes -1..1]``          4 + ceil(n/4)         yes
``topk1``            ``[k values f32][k indices int32]``, 1%        8k                    yes
``topk3``            the same, density 3%                           8k                    yes
``topk10``           the same, density 10%                          8k                    yes
``topk1_absmax2``    ``[scale f32][k idx int32][k 2-bit codes]``    4 + 4k + ceil(k/4)    yes
``topk3_absmax2``    the same, density 3%                           4 + 4k + ceil(k/4)    yes
===================  =============================================  ====================  ================

``absmax4``/``absmax2`` decode ``code * scale`` (codes round-half-even(x / scale), so at most scale/2 is
lost per element; ``absmax2`` sends ``+-max|x|`` where ``|x| > max|x|/2`` and 0 elsewhere). ``topk*`` sends
the k largest ``|x|`` (ties to the lower index; indices ascending) and decodes to zeros elsewhere;
:class:`TopKCompressor` takes any density. ``topk*_absmax2`` quantizes those k values as ``absmax2`` does,
with one scale (the largest of the k ``|values|``).

``none`` means no compression. A user's compressor is one short subclass, registered by name and then
usable in YAML (``compression: int4``) with any of those algorithms::

    import torch, bagua_lite

    @bagua_lite.register_compressor("int4")
    class Int4(bagua_lite.Compressor):
        '''Absmax 4-bit quantization: [scale f32][n int8 codes in -7..7] (a byte per code, for brevity).'''
        error_feedback = True   # the framework keeps a residual for it

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

A Python compressor runs through the same collectives as the built-ins (a generic all-to-all/allgather
path in :mod:`bagua_lite.comm`), only slower. The wire buffers it is handed start at an 8-byte boundary,
so views such as ``out[:4].view(torch.float32)`` work.
"""
from typing import Dict, List, Optional, Type, Union

import torch

from . import _C, runtime

__all__ = ["Compressor", "register_compressor", "get_compressor", "registered_compressors", "encode",
           "TopKCompressor", "TopKAbsMax2Compressor"]


class Compressor:
    """Base class of every compressor. Subclasses must be constructible without arguments."""

    #: registry name, set by :func:`register_compressor`
    name: str = "compressor"
    #: the compression loses so much that the sender should keep error-feedback memory
    error_feedback: bool = False
    #: the C++ core implements it under ``name`` (collectives then run it without the GIL)
    native: bool = False

    def wire_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def compress(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write the wire bytes of ``x`` (contiguous, floating) into ``out`` (uint8, ``wire_bytes`` long)."""
        raise NotImplementedError

    def decompress(self, wire: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """Decode ``wire`` into ``out`` (overwrite, or add when ``accumulate``)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<compressor {self.name}>"


class _Native(Compressor):
    native = True

    def __init__(self, name: str, error_feedback: bool = False):
        self.name, self.error_feedback = name, error_feedback

    def wire_bytes(self, numel):
        return _C.wire_bytes(self.name, numel)

    def compress(self, x, out):
        _C.compress_into(x, self.name, out)

    def decompress(self, wire, out, accumulate=False):
        _C.decompress_into(wire, self.name, out, accumulate)


_BUILTIN = {"fp16": _Native("fp16"), "bf16": _Native("bf16"), "minmax_uint8": _Native("minmax_uint8"),
            "sign": _Native("sign", error_feedback=True)}
_REGISTRY: Dict[str, Union[Compressor, Type[Compressor]]] = dict(_BUILTIN)


def register_compressor(name: str):
    """Class decorator: make a :class:`Compressor` subclass selectable as ``compression: name``."""
    if not isinstance(name, str) or not name or name == "none":
        raise ValueError(f"register_compressor: name must be a non-empty string other than 'none', got {name!r}")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Compressor)):
            raise TypeError(f"register_compressor({name!r}): {cls!r} is not a subclass of bagua_lite.Compressor")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"register_compressor: a compressor named {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def registered_compressors() -> List[str]:
    """Every name ``compression:`` accepts, ``"none"`` included."""
    return ["none"] + sorted(_REGISTRY)


def get_compressor(compression: Union[str, Compressor, None], who: str = "compression") -> Optional[Compressor]:
    """The compressor for a name (or an instance, returned as it is); ``None`` for ``"none"``/None.

    An unknown name raises a ValueError that names it and lists the registered ones.
    """
    if compression is None or compression == "none":
        return None
    if isinstance(compression, Compressor):
        return compression
    entry = _REGISTRY.get(compression) if isinstance(compression, str) else None
    if entry is None:
        raise ValueError(f"{who}: unknown compression {compression!r}; choose one of "
                         + ", ".join(repr(n) for n in registered_compressors())
                         + " or register your own with bagua_lite.register_compressor")
    return entry() if isinstance(entry, type) else entry


def encode(compressor: Compressor, x: torch.Tensor, wire: torch.Tensor,
           residual: Optional[torch.Tensor] = None) -> None:
    """Compress ``x`` into ``wire``; with ``residual`` (error feedback) compress ``x + residual`` instead
    and leave in ``residual`` what the receiver will not see. ``x`` is overwritten with what was meant
    to be sent (``x + residual``) when a residual is given."""
    if residual is None:
        compressor.compress(x, wire)
        return
    x.add_(residual)
    compressor.compress(x, wire)
    compressor.decompress(wire, residual, accumulate=False)
    torch.sub(x, residual, out=residual)


# ---------------------------------------------------------------------------------------------------------
# built-in Python compressors for the DiLoCo family (SparseLoCo: diloco + top-k + 2-bit); stateless, all with
# error feedback. They compute in float32 whatever the input dtype (float16/bfloat16/float64 are converted),
# decode in float32 and then cast into ``out``. Non-finite inputs do not raise (the framework checks
# finiteness before compressing): the codes of NaN elements are 0 and an infinite scale decodes to inf/NaN.


def _absmax_codes(x: torch.Tensor, levels: int):
    """float32 scale = max|x| / levels and int16 codes round-half-even(x / scale) clamped to -levels..levels
    (all zero when the scale is 0)."""
    xf = x.reshape(-1).to(torch.float32)
    if xf.numel() == 0:
        return torch.zeros((), device=xf.device), torch.zeros(0, dtype=torch.int16, device=xf.device)
    scale = xf.abs().max() / levels
    if float(scale) > 0:
        q = torch.nan_to_num(torch.round(xf / scale), nan=0.0, posinf=levels, neginf=-levels)
        codes = q.clamp_(-levels, levels).to(torch.int16)
    else:  # all zero (or NaN everywhere: the scale is NaN and every code 0)
        codes = torch.zeros(xf.numel(), dtype=torch.int16, device=xf.device)
    return scale, codes


def _pack(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes (uint8 values < 2**bits) into bytes, element i of each group of 8/bits at
    bit offset ``bits * (i % (8/bits))`` (little-endian in the byte); the padding fields of the last byte are 0."""
    per = 8 // bits
    n = u.numel()
    padded = torch.zeros((n + per - 1) // per * per, dtype=torch.uint8, device=u.device)
    padded[:n] = u
    groups = padded.view(-1, per)
    out = groups[:, 0].clone()
    for j in range(1, per):  # 2 or 4 fields per byte: a loop over bit positions, not elements
        out |= groups[:, j] << (bits * j)
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    fields = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(fields, 1).reshape(-1)[:n]


def _cpu_float32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _deliver(vals: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    # rounded to out's dtype first, so that accumulating adds exactly what decompress would write
    vals = vals.to(out.dtype).view_as(out)
    out.add_(vals) if accumulate else out.copy_(vals)


class _AbsMaxLowBit(Compressor):
    """Absmax quantization to ``bits``-bit codes: ``[scale f32][ceil(n * bits / 8) bytes]``."""

    error_feedback = True
    bits = 4

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1  # 7 for 4 bits, 1 for 2 bits

    def wire_bytes(self, n):
        per = 8 // self.bits
        return 4 + (n + per - 1) // per

    def compress(self, x, out):
        if _C.cuda_handles_codec(x):  # the CUDA kernels: the same bytes, no host synchronisation
            _C.absmax_encode_cuda(x.reshape(-1).contiguous(), out[:4], out[4:self.wire_bytes(x.numel())], self.bits)
            return
        if _cpu_float32(x):  # the C++ kernel: the same bytes, no temporaries
            _C.absmax_encode_cpu(x.view(-1), out[:4], out[4:self.wire_bytes(x.numel())], self.bits)
            return
        scale, codes = _absmax_codes(x, self.levels)
        out[:4].view(torch.float32)[0] = scale
        # biased codes: code + levels in 0..2*levels (fits ``bits`` bits)
        out[4:self.wire_bytes(codes.numel())].copy_(_pack((codes + self.levels).to(torch.uint8), self.bits))

    def decompress(self, wire, out, accumulate=False):
        n = out.numel()
        if out.dtype == torch.float32 and out.is_contiguous() and _C.cuda_handles_codec(out):
            _C.absmax_decode_cuda(wire[:4], wire[4:self.wire_bytes(n)], out.view(-1), self.bits, accumulate)
            return
        if _cpu_float32(out):
            _C.absmax_decode_cpu(wire[:4], wire[4:self.wire_bytes(n)], out.view(-1), self.bits, accumulate)
            return
        scale = wire[:4].view(torch.float32)[0]
        codes = _unpack(wire[4:self.wire_bytes(n)], self.bits, n).to(torch.float32) - self.levels
        _deliver(codes * scale, out, accumulate)


class AbsMax4(_AbsMaxLowBit):
    """``absmax4``: scale = max|x| / 7 (float32), codes round-half-even(x / scale) in -7..7, stored biased
    (code + 7, 0..14) as 4-bit fields, two per byte (element 2i in the low nibble of byte i, 2i+1 in the
    high nibble). Decoded value: code * scale; the error is at most scale / 2 per element."""

    bits = 4


class AbsMax2(_AbsMaxLowBit):
    """``absmax2``: ternary absmax quantization. scale = max|x| (float32), codes round-half-even(x / scale)
    in {-1, 0, +1} -- an element is sent as +-scale when |x| > max|x| / 2, else as 0 -- stored biased
    (code + 1, 0..2) as 2-bit fields, four per byte (element 4i+j at bits 2j..2j+1 of byte i). Decoded
    value: code * scale; the error is at most scale / 2 per element, and error feedback sends the rest later."""

    bits = 2


def _topk_indices(xf: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k largest |xf|, ties going to the lower index (NaN counts as +inf; on CUDA as
    larger than +inf), so the choice is a function of the values alone (numpy: the first k of a stable argsort
    of -|x|). int64, or int32 from the CUDA kernel."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=xf.device)
    if _C.cuda_handles_codec(xf):  # the CUDA kernel: the same choice, no host synchronisation (NaN: largest)
        return _C.topk(xf, k)[1]
    if _cpu_float32(xf) and _C.all_finite(xf):  # the CPU kernel (which refuses NaN): the same choice
        return _C.topk(xf, k)[1]
    a = torch.nan_to_num(xf.abs(), nan=float("inf"))
    if k == a.numel():
        return torch.arange(k, device=xf.device)
    v = torch.topk(a, k, sorted=False).values.min()  # the k-th largest magnitude
    above = (a > v).nonzero().view(-1)
    at = (a == v).nonzero().view(-1)[:k - above.numel()]
    return torch.cat([above, at]).sort().values


class TopKCompressor(Compressor):
    """Top-k sparsification by magnitude: ``[k values f32][k indices int32]`` with
    ``k = min(n, max(1, round(density * n)))`` (0 for n = 0; Python's ``round``), computed from n alone so
    every rank agrees on the wire size. The k elements of largest |x| are sent (ties go to the lower index;
    NaN counts as largest), indices ascending; decompress scatters them into zeros (or adds
    them when ``accumulate``). Register a density as ``register_compressor(name)(TopKCompressor.of(d))``."""

    error_feedback = True
    density = 0.01

    def __init__(self, density: Optional[float] = None):
        if density is not None:
            self.density = float(density)
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"TopKCompressor: density must be in (0, 1], got {self.density!r}")

    @classmethod
    def of(cls, density: float) -> Type["TopKCompressor"]:
        """A subclass with ``density`` fixed (registry entries are constructed without arguments)."""
        if not 0.0 < float(density) <= 1.0:
            raise ValueError(f"TopKCompressor: density must be in (0, 1], got {density!r}")
        return type(f"TopK{density:g}", (cls,), {"density": float(density), "__doc__": cls.__doc__})

    def k(self, n: int) -> int:
        return 0 if n <= 0 else min(n, max(1, round(self.density * n)))

    def wire_bytes(self, n):
        return 8 * self.k(n)

    def compress(self, x, out):
        xf = x.reshape(-1).to(torch.float32)
        k = self.k(xf.numel())
        if k == 0:
            return
        idx = _topk_indices(xf, k)
        out[:4 * k].view(torch.float32).copy_(xf[idx])
        out[4 * k:8 * k].view(torch.int32).copy_(idx)

    def decompress(self, wire, out, accumulate=False):
        k = self.k(out.numel())
        self._scatter(out, accumulate, k, lambda: (wire[4 * k:8 * k], wire[:4 * k].view(torch.float32)))

    @staticmethod
    def _scatter(out, accumulate, k, pairs):
        """Zero ``out`` unless accumulating, then add the k (int32 index bytes, float32 values) of ``pairs()``."""
        flat = out.view(-1)
        if not accumulate:
            flat.zero_()
        if k == 0:
            return
        idx_bytes, vals = pairs()
        if _cpu_float32(out) and vals.dtype == torch.float32:  # distinct indices: index_add_'s sums, no copies
            _C.scatter_add_(flat, vals, idx_bytes.view(torch.int32))
        else:
            flat.index_add_(0, idx_bytes.view(torch.int32).to(torch.int64), vals.to(out.dtype))


class TopKAbsMax2Compressor(TopKCompressor):
    """Top-k, then the k values quantized as ``absmax2`` does (SparseLoCo): ``[scale f32][k indices int32]
    [ceil(k/4) bytes of 2-bit codes]``, scale = max of the k |values|, codes round-half-even(v / scale) in
    {-1, 0, +1} stored biased (code + 1) four per byte, low bits first. Decompress scatters code * scale
    (selected values whose code is 0 decode to 0 and stay in the error-feedback residual)."""

    def wire_bytes(self, n):
        k = self.k(n)
        return 4 + 4 * k + (k + 3) // 4

    def compress(self, x, out):
        xf = x.reshape(-1).to(torch.float32)
        k = self.k(xf.numel())
        idx = _topk_indices(xf, k)
        out[4:4 + 4 * k].view(torch.int32).copy_(idx)
        if _C.cuda_handles_codec(xf):  # the absmax2 kernel: the same bytes, no host synchronisation
            _C.absmax_encode_cuda(xf[idx], out[:4], out[4 + 4 * k:self.wire_bytes(xf.numel())], 2)
            return
        if _cpu_float32(xf):  # the absmax2 kernel on the CPU: the same bytes, the k values gathered into a kept buffer
            vals = torch.index_select(xf, 0, idx, out=runtime.kept_buffer("selected", k, torch.float32, "cpu"))
            _C.absmax_encode_cpu(vals, out[:4], out[4 + 4 * k:self.wire_bytes(xf.numel())], 2)
            return
        scale, codes = _absmax_codes(xf[idx], 1)
        out[:4].view(torch.float32)[0] = scale
        out[4 + 4 * k:self.wire_bytes(xf.numel())].copy_(_pack((codes + 1).to(torch.uint8), 2))

    def decompress(self, wire, out, accumulate=False):
        k = self.k(out.numel())

        def pairs():
            codes_bytes = wire[4 + 4 * k:4 + 4 * k + (k + 3) // 4]
            if _cpu_float32(out):  # the absmax2 kernel, into a buffer kept per thread
                vals = runtime.kept_buffer("decoded", k, torch.float32, "cpu")
                _C.absmax_decode_cpu(wire[:4], codes_bytes, vals, 2, False)
                return wire[4:4 + 4 * k], vals
            codes = _unpack(codes_bytes, 2, k).to(torch.float32) - 1
            return wire[4:4 + 4 * k], codes * wire[:4].view(torch.float32)[0]
        self._scatter(out, accumulate, k, pairs)


register_compressor("absmax4")(AbsMax4)
register_compressor("absmax2")(AbsMax2)
register_compressor("topk1")(TopKCompressor.of(0.01))
register_compressor("topk3")(TopKCompressor.of(0.03))
register_compressor("topk10")(TopKCompressor.of(0.10))
register_compressor("topk1_absmax2")(TopKAbsMax2Compressor.of(0.01))
register_compressor("topk3_absmax2")(TopKAbsMax2Compressor.of(0.03))
