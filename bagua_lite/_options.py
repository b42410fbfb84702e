"""Checks of an algorithm's options, written (and worded) once: ``who: name must be ..., got value``.

Each raises ValueError before any traffic and returns the value, so a constructor reads
``self.rank = int_at_least(self.name, "rank", rank, 1)``. Types are checked too (a bool is not a
number), for algorithms built directly rather than through ``build`` (which checks types as well).
"""
import inspect
import math

from . import compressors

MAX_INT_OPTION = 2 ** 31  # a period or step count beyond this is a typo (and overflows int32 counters)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_at_least(who: str, name: str, value, least: int, why: str = ""):
    """An int >= ``least``; ``why``: what the bound means, e.g. " (milliseconds)"."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{who}: {name} must be an int >= {least}{why}, got {value!r}")
    return value


def number_at_least(who: str, name: str, value, least: float, why: str = ""):
    """A number (int or float, not NaN) >= ``least``."""
    if not _is_number(value) or not value >= least:  # NaN fails too
        raise ValueError(f"{who}: {name} must be a number >= {least:g}{why}, got {value!r}")
    return value


def within(who: str, name: str, value, interval: str, why: str = ""):
    """A number in ``interval``, written as in the message: "(0, 1]" is 0 < value <= 1, "[0, 1)" ..."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    ok = _is_number(value) and (lo < value if interval[0] == "(" else lo <= value) \
        and (value < hi if interval[-1] == ")" else value <= hi)
    if not ok:
        raise ValueError(f"{who}: {name}{why} must be in {interval}, got {value!r}")
    return value


def compressor(who: str, compression, why: str = ""):
    """The compressor named ``compression``, which must not be "none" (the algorithm only sends compressed)."""
    if compression is None or compression == "none":
        raise ValueError(f"{who}: compression must be a compressor, not {compression!r}{why}; choose one of "
                         + ", ".join(repr(n) for n in compressors.registered_compressors() if n != "none"))
    return compressors.get_compressor(compression, who)


def check_option_type(alg, key, value, default):
    """``build``'s check of option ``key`` of algorithm ``alg``: ``value`` of its ``default``'s type, finite,
    and an int below 2**31."""
    if default is inspect._empty or default is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise TypeError(f"algorithm {alg!r}: option {key!r} must be of type {type(default).__name__} "
                        f"(like its default {default!r}), got {type(value).__name__} {value!r}")
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"algorithm {alg!r}: option {key!r} must be finite, got {v!r}")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= MAX_INT_OPTION:
            raise ValueError(f"algorithm {alg!r}: option {key!r} = {v} is absurdly large (must be below 2**31)")

