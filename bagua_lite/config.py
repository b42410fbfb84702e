"""YAML configuration: which algorithm, with which options, and the bucket size.

    algorithm:
      name: gtopk
      density: 0.001
    bucket_size_mb: 25

``load_config(path)`` reads a file, ``load_config("gtopk")`` a shipped config by name (``<algorithm>``:
that algorithm's defaults, exactly ``algorithm="<algorithm>"``; ``bytegrad``, ``streaming_diloco``, ...:
named variants; :func:`shipped_configs` lists them), ``parse_config(text)`` a YAML string; all validate
everything (unknown keys get the nearest valid name suggested) before any process-group traffic.
"""
import difflib
import importlib.resources
import math
import os
import re
from dataclasses import dataclass, field
from typing import List

import yaml

from .algorithm import Algorithm, build, registered

TOP_LEVEL_KEYS = ("algorithm", "bucket_size_mb")
MAX_BUCKET_MB = 1 << 20  # 1 TiB: anything larger is a typo


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``; users write both) and
    refuses a key given twice in one mapping (plain YAML lets the last one silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ValueError(f"config: key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                 "each key may appear once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


@dataclass
class Config:
    algorithm: Algorithm
    bucket_size_mb: float = 25.0
    raw: dict = field(default_factory=dict)


def _unknown(kind, key, allowed):
    near = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ValueError(f"config: unknown {kind} {key!r}{hint} (allowed: {', '.join(allowed)})")


def config_from_dict(data, source="<dict>") -> Config:
    from . import algorithms  # noqa: F401  (registers the built-ins; at use: they import this package)

    if not isinstance(data, dict):
        raise ValueError(f"config {source}: expected a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise _unknown("key", key, TOP_LEVEL_KEYS)
    if "algorithm" not in data:
        raise ValueError(f"config {source}: missing required key 'algorithm'")
    alg = data["algorithm"]
    if isinstance(alg, str):
        alg = {"name": alg}
    if not isinstance(alg, dict) or "name" not in alg:
        raise ValueError(f"config {source}: 'algorithm' must be a name or a mapping with a 'name' key, got {alg!r}")
    options = {k: v for k, v in alg.items() if k != "name"}
    bucket = data.get("bucket_size_mb", 25.0)
    if not isinstance(bucket, (int, float)) or isinstance(bucket, bool):
        raise TypeError(f"config {source}: bucket_size_mb must be a number, got {type(bucket).__name__} {bucket!r}")
    if not math.isfinite(bucket) or not 0 < bucket <= MAX_BUCKET_MB:
        raise ValueError(f"config {source}: bucket_size_mb must be > 0 and <= {MAX_BUCKET_MB} (finite), got {bucket}")
    return Config(algorithm=build(alg["name"], **options), bucket_size_mb=float(bucket), raw=data)


def parse_config(text: str) -> Config:
    """Parse and validate a YAML string."""
    return config_from_dict(yaml.load(text, Loader=_Loader), "<string>")


def _shipped_dir():
    return importlib.resources.files("bagua_lite.configs")


def shipped_configs(benchmark: bool = False) -> List[str]:
    """The names :func:`load_config` takes besides paths: the training configs installed with the package
    (``benchmark=True``: the benchmark's matrices, ``python -m bagua_lite.bench --config <name>``)."""
    return sorted(f.name[:-len(".yaml")] for f in _shipped_dir().iterdir()
                  if f.name.endswith(".yaml") and f.name.startswith("benchmark") == benchmark)


def shipped_path(name: str, benchmark: bool = False):
    """The installed file of shipped config ``name`` (``"gtopk"`` or ``"gtopk.yaml"``), or None."""
    name = name[:-len(".yaml")] if name.endswith(".yaml") else name
    if name in shipped_configs(benchmark):
        return _shipped_dir() / f"{name}.yaml"
    return None


def load_config(path) -> Config:
    """Read and validate a YAML file, or a shipped config by name: ``load_config("gtopk")`` (from any
    directory; a file of that name in the working directory is read instead)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        with open(path) as f:
            return config_from_dict(yaml.load(f, Loader=_Loader), path)
    shipped = shipped_path(path)
    if shipped is not None:
        return config_from_dict(yaml.load(shipped.read_text(), Loader=_Loader), f"bagua_lite.configs/{shipped.name}")
    raise FileNotFoundError(f"config: no such file {path!r}, and no shipped config of that name (shipped: "
                            f"{', '.join(shipped_configs())})")


def algorithm_from(spec, who: str):
    """``(algorithm, the config's bucket_size_mb or None)`` from what a user may pass as ``algorithm=``: an
    :class:`Algorithm`, a registered name (its defaults), or what :func:`load_config` takes (a YAML path, a
    shipped config's name). A registered name wins over a shipped config of the same name (the same
    defaults) unless a file of that name exists here."""
    from . import algorithms  # noqa: F401  (registers the built-ins; at use: they import this package)

    if isinstance(spec, Algorithm):
        return spec, None
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"{who}: algorithm must be a bagua_lite.Algorithm, a registered name or a YAML config "
                        f"path, got {type(spec).__name__}")
    text = os.fspath(spec)
    if text in registered() and not os.path.isfile(text):
        return build(text), None
    if os.path.isfile(text) or shipped_path(text) is not None:
        cfg = load_config(text)
        return cfg.algorithm, cfg.bucket_size_mb
    raise ValueError(f"{who}: unknown algorithm {text!r}; known algorithms: {', '.join(registered())}; or a "
                     f"YAML config: no file {text!r} here, and no shipped config of that name "
                     f"({', '.join(shipped_configs())})")
