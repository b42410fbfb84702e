"""The compression axis: what a dense tensor looks like on the wire.

A :class:`Compressor` turns ``n`` elements into ``wire_bytes(n)`` bytes (a uint8 tensor) and back. It
says *what to send*; *what to remember* -- error-feedback memory, the part compression lost, sent again
next time -- is kept by the framework (the collectives and algorithms take a ``residual`` buffer and
:func:`encode` updates it), so a compressor never holds state and works under every algorithm that
moves dense tensors: ``gradient_allreduce``, ``decentralized``, ``local_sgd``, ``async_model_average``,
``qadam``.

Built-ins (C++ fast paths, GIL released):

================  ==========================================  ==================  ==============
name              wire format for n elements                  bytes               error feedback
================  ==========================================  ==================  ==============
``fp16``          IEEE half                                   2n                  no
``bf16``          bfloat16 (float32's range: never overflows)  2n                  no
``minmax_uint8``  ``[min f32][max f32][n uint8]``              8 + n               no
``sign``          ``[mean abs f32][n bits]``                   4 + ceil(n/8)       yes
================  ==========================================  ==================  ==============

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

from . import _C

__all__ = ["Compressor", "register_compressor", "get_compressor", "registered_compressors", "encode"]


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
