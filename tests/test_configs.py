"""The shipped configs: installed with the package, loadable by name from any directory, and one set of
defaults per algorithm name (``configs/<name>.yaml`` shows exactly what ``algorithm="<name>"`` builds).

Single process: nothing here starts a process group.
"""
import glob
import os
import subprocess
import sys

import pytest
import yaml

import bagua_lite
from bagua_lite.algorithm import build, option_names, registered
from bagua_lite.demo import digits_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT_IN = [n for n in registered() if type(build(n)).__module__.startswith("bagua_lite.algorithms.")]
# options whose default is None and resolved by the constructor: the YAML shows the resolved value, and
# the attribute holding it must be the same either way
RESOLVED = {"momentum_correction": "momentum_correction", "outer_optimizer": "outer_spec"}


def _plain(value):
    """Tuples as lists, recursively: a YAML file has only lists."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_config_named_after_an_algorithm_shows_its_defaults(name):
    path = os.path.join(ROOT, "configs", f"{name}.yaml")
    assert os.path.exists(path), f"configs/{name}.yaml is missing: every built-in algorithm ships its defaults"
    with open(path) as f:
        shown = yaml.safe_load(f)["algorithm"]
    shown.pop("name")
    cls = type(build(name))
    assert sorted(shown) == sorted(option_names(cls)), f"configs/{name}.yaml must show every option"
    default, loaded = build(name), bagua_lite.load_config(name).algorithm
    assert type(loaded) is cls
    for key, value in default.options().items():
        if value is None and key in RESOLVED:
            assert getattr(loaded, RESOLVED[key]) == getattr(default, RESOLVED[key]), (name, key)
        else:
            assert _plain(loaded.options()[key]) == _plain(value), \
                f"configs/{name}.yaml redefines {key}: {loaded.options()[key]!r}, the default is {value!r}"
    assert bagua_lite.load_config(name).bucket_size_mb == 25.0  # DistributedModel's default too


def test_every_shipped_training_config_loads_by_name_and_path():
    names = bagua_lite.shipped_configs()
    files = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert names == [n for n in files if not n.startswith("benchmark")]
    assert set(BUILT_IN) <= set(names)
    for name in names:
        by_name = bagua_lite.load_config(name)
        by_path = bagua_lite.load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
        assert repr(by_name.algorithm) == repr(by_path.algorithm)
        assert repr(bagua_lite.load_config(f"{name}.yaml").algorithm) == repr(by_path.algorithm)
    assert bagua_lite.shipped_configs(benchmark=True) == [n for n in files if n.startswith("benchmark")]


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError) as info:
        bagua_lite.load_config("gtopkk")
    assert "'gtopkk'" in str(info.value) and "gtopk, " in str(info.value) and "streaming_diloco" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no such file 'nowhere/gtopk.yaml'"):
        bagua_lite.load_config("nowhere/gtopk.yaml")  # a path is a path: never swapped for a shipped file


def test_a_file_in_the_working_directory_wins_over_the_shipped_name(tmp_path, monkeypatch):
    (tmp_path / "gtopk").write_text("algorithm: {name: gtopk, density: 0.02}\n")
    monkeypatch.chdir(tmp_path)
    assert bagua_lite.load_config("gtopk").algorithm.density == 0.02


def test_load_config_by_name_from_any_directory(tmp_path):
    """As a user pastes it: a fresh interpreter, a plain ``import bagua_lite``, another working directory."""
    code = ("import bagua_lite; c = bagua_lite.load_config('gtopk'); "
            "print(type(c.algorithm).__name__, c.algorithm.density, len(bagua_lite.shipped_configs()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["GTopK", "0.001", str(len(bagua_lite.shipped_configs()))]


def test_every_digits_recipe_tunes_a_shipped_config():
    tuned = sorted(glob.glob(os.path.join(ROOT, "examples", "digits", "*.yaml")))
    assert tuned, "examples/digits/ holds the recipes for the small digits model"
    for path in tuned:
        name = os.path.basename(path)[:-5]
        assert name in bagua_lite.shipped_configs(), f"{path}: no configs/{name}.yaml for it to tune"
        assert type(bagua_lite.load_config(path).algorithm) is type(bagua_lite.load_config(name).algorithm)
        assert path in digits_configs(ROOT)
    assert len(digits_configs(ROOT)) == len(bagua_lite.shipped_configs())
