"""The code's layout, checked: no module reaches into another module's private members, imports point one
way (no cycles, counting the imports inside functions too), and an import inside a function says why it
is not at the top. Reads the sources (ast); imports nothing of bagua_lite."""
import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (package name, folder): bagua_lite.algorithms is installed from algorithms/ (package_dir)
PACKAGES = (("bagua_lite", "bagua_lite"), ("bagua_lite.algorithms", "algorithms"))
PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")  # _name, not __dunder__
MAX_LINES = 440  # the largest module of the runtime (bagua_lite/ but bench/): about 400, docstrings included


def _modules():
    """{module name: path} of every module of ours."""
    out = {}
    for pkg, folder in PACKAGES:
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not (pkg == "bagua_lite" and d == "algorithms")]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                    name = pkg if rel == "__init__" else f"{pkg}.{rel[:-len('.__init__')] if rel.endswith('.__init__') else rel}"
                    out[name] = os.path.join(dirpath, f)
    return out


MODULES = _modules()
TREES = {name: ast.parse(open(path).read(), path) for name, path in MODULES.items()}
SOURCES = {name: open(path).read().split("\n") for name, path in MODULES.items()}


def _owned(tree):
    """The private names a module defines: functions, classes, module and class attributes, and the
    attributes its methods set on ``self``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {n for n in names if PRIVATE.match(n)}


OWNED = {name: _owned(tree) for name, tree in TREES.items()}


def _is_package(name):
    return MODULES[name].endswith("__init__.py")


def _resolve(module, node):
    """The modules of ours an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parent = parts if _is_package(module) else parts[:-1]
        parent = parent[:len(parent) - (node.level - 1)]
        base = ".".join(parent + ([base] if base else []))
    if base.startswith("bagua_lite.algorithms") or base == "bagua_lite.algorithms":
        pass
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in MODULES:
            out.append(sub)
        elif base in MODULES:
            out.append(base)
    return out


def _imports():
    """[(importer, imported, line number, inside a function)] over every module of ours."""
    edges = []
    for name, tree in TREES.items():
        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _resolve(name, child):
                        edges.append((name, target, child.lineno, in_function))
                visit(child, inner)
        visit(tree, False)
    return edges


def test_layout_reads_every_module():
    assert "bagua_lite.distributed" in MODULES and "bagua_lite.algorithms.topk" in MODULES
    assert "bagua_lite.bench.runner" in MODULES and len(MODULES) > 40, sorted(MODULES)
    assert any(t == "bagua_lite.scheduler" for _, t, _, _ in _imports())


def test_no_private_member_used_across_modules():
    """``obj._name`` where ``_name`` belongs to another module of ours (not ``self``'s and not torch's), and
    ``from .mod import _name``: what one module keeps private, no other one touches."""
    owners = {}
    for name, owned in OWNED.items():
        for n in owned:
            owners.setdefault(n, set()).add(name)
    found = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr) \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                if node.attr in OWNED[name] or node.attr not in owners:
                    continue  # this module's own, or not ours (torch's)
                if isinstance(node.value, ast.Name) and f"{name}.{node.value.id}" not in MODULES \
                        and node.value.id in ("torch", "dist", "np"):
                    continue
                found.append(f"{MODULES[name]}:{node.lineno}: .{node.attr} (of {sorted(owners[node.attr])})")
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(name, node)
                for a in node.names:
                    if PRIVATE.match(a.name) and f"{targets[0] if targets else ''}.{a.name}" not in MODULES \
                            and targets and a.name in OWNED.get(targets[0], ()):
                        found.append(f"{MODULES[name]}:{node.lineno}: from {targets[0]} import {a.name}")
    assert not found, "private members used across modules:\n" + "\n".join(found)


def _cycles(edges):
    graph = {}
    for a, b, _, _ in edges:
        if a != b and not _is_package(a) and not _is_package(b):
            graph.setdefault(a, set()).add(b)
    cycles, state = [], {}

    def walk(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2
    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    return cycles


def test_no_import_cycles():
    """Between modules (packages' ``__init__`` aside: they gather their modules), counting the imports inside
    functions, which hide a cycle as well as they break one."""
    cycles = _cycles(_imports())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_detection_sees_a_cycle():
    edges = [("bagua_lite.comm", "bagua_lite.kernels", 1, False), ("bagua_lite.kernels", "bagua_lite.comm", 9, True)]
    assert _cycles(edges) == [["bagua_lite.comm", "bagua_lite.kernels", "bagua_lite.comm"]]


def test_imports_inside_functions_say_why():
    """An import of one of our modules inside a function carries a comment saying why it is not at the top
    (an optional dependency, the built-in algorithms' registration, a heavy module kept lazy)."""
    silent = []
    for importer, _, line, in_function in _imports():
        text = SOURCES[importer][line - 1]
        if in_function and "#" not in text:
            silent.append(f"{MODULES[importer]}:{line}: {text.strip()}")
    assert not silent, "imports inside functions without a reason:\n" + "\n".join(sorted(set(silent)))


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("bagua_lite.")
                                        and not n.startswith(("bagua_lite.bench", "bagua_lite.algorithms"))))
def test_runtime_modules_stay_small(name):
    lines = len(SOURCES[name])
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_LINES}): split it by concern"


def test_importing_bagua_lite_leaves_dynamo_and_fsdp2_unimported():
    """Every rank of every job imports bagua_lite: dynamo (torch.compiler.disable at class definition) would
    add 2.5 s to that, FSDP2 and DTensor 1 s; they are imported when a compile or a sharded model needs them."""
    heavy = ["torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp"]
    code = f"import sys, bagua_lite; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
