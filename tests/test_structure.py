"""The package's shape, read from its source: every module in a folder of one job, folders
importing only the folders below them, no import cycle, nothing loaded by a string, no
private name used across modules, and ``core`` the only caller of the native core.

docs/ARCHITECTURE.md describes the layers these checks keep honest.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "fusedenc"
#: Generated or native modules: their private names are the point of importing them.
NATIVE = {"fusedenc._C", "fusedenc._build_info"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The build's generated modules (a build installed into the tree puts _build_info.py there) are
# the native core's, not sources of a layer.
SOURCES = {name: p for p in sorted(ROOT.rglob("*.py")) if (name := _module_name(p)) not in NATIVE}
TREES = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in SOURCES.items()}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names."""
    if node.level == 0:
        return node.module or ""
    package = module if SOURCES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str) -> list[tuple[str, str, ast.AST]]:
    """``(imported module, bound name, node)`` for every import in ``module``, at any depth
    (an import inside a function is an edge too: it runs as soon as the function does)."""
    out = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, alias.asname or alias.name.split(".")[0], node))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in SOURCES or full in NATIVE else base
                out.append((target, alias.asname or alias.name, node))
    return out


def _graph() -> dict[str, set[str]]:
    """Edges between fusedenc modules.  Importing a submodule also runs its parent packages'
    ``__init__``; those implicit edges are left out, as import tools do (every package that
    re-exports its submodules would otherwise be a cycle)."""
    return {
        m: {t for t, _, _ in _imports(m) if t in SOURCES and t != m and not m.startswith(t + ".")} for m in SOURCES
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checks_see_the_package():
    assert {"fusedenc", "fusedenc.core", "fusedenc.attention", "fusedenc.attention.plans", "fusedenc.tune.gemm"} <= set(
        SOURCES
    )
    graph = _graph()
    assert "fusedenc.core" in graph["fusedenc.ops.gemm"] and "fusedenc.attention.call" in graph["fusedenc.attention.plans"]


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert cycles == [], f"import cycles among fusedenc modules: {cycles}"


def test_nothing_is_loaded_by_a_string():
    found = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name in ("import_module", "__import__"):
                    found.append(f"{module}:{node.lineno}")
    assert found == [], f"modules loaded by name (invisible to tools): {found}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_crosses_modules():
    """``from .x import _y`` and ``x._y`` on a fusedenc module are both private use across modules."""
    found = []
    for module, tree in TREES.items():
        bound_modules = {}  # names this module binds to fusedenc modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in SOURCES:
                        bound_modules[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                for alias in node.names:
                    if f"{base}.{alias.name}" in SOURCES:
                        bound_modules[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                if base.startswith("fusedenc") and base not in NATIVE and base != module:
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        if full not in SOURCES and full not in NATIVE and _private(alias.name):
                            found.append(f"{module}:{node.lineno} imports {base}.{alias.name}")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound_modules
                and _private(node.attr)
            ):
                found.append(f"{module}:{node.lineno} uses {bound_modules[node.value.id]}.{node.attr}")
    assert sorted(set(found)) == [], f"private names used across modules: {sorted(set(found))}"


@pytest.mark.parametrize("allowed", [{"fusedenc.core", "fusedenc.core.fp8", "fusedenc.core.hopper"}])
def test_core_is_the_only_caller_of_the_native_core(allowed):
    """Only ``core`` imports ``_C``, calls ``native_module()`` or looks up a Triton route."""
    found = []
    for module, tree in TREES.items():
        if module in allowed:
            continue
        for target, _, node in _imports(module):
            if target == "fusedenc._C":
                found.append(f"{module}:{node.lineno} imports _C")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("native_module", "lookup"):
                if isinstance(node.value, ast.Name) and node.value.id in ("core", "gemm_routes"):
                    found.append(f"{module}:{node.lineno} calls {node.value.id}.{node.attr}")
    assert found == [], f"native-core calls outside the core package: {found}"


#: The folders of ``fusedenc``, lowest first (configs: the shipped tables, data only): a module
#: may import its own folder and the folders before its own, never one after it; entry points
#: (``__main__`` modules, what ``python -m`` runs) may reach any folder, still without a cycle
#: (docs/ARCHITECTURE.md draws this picture).
LAYERS = ("configs", "common", "core", "ops", "fp8", "attention", "graphs", "varlen", "encoder", "hf", "tune", "lc0",
          "embed", "distributed")
#: The modules beside the folders: the public surface, which may import any folder, and two
#: re-exports that keep the module names earlier releases documented working.
TOP = {"fusedenc", "fusedenc.__main__", "fusedenc.report", "fusedenc.testing",
       "fusedenc.auto_graphs", "fusedenc.fp8_range"}  # the last two: earlier releases' documented names


def _folder(module: str) -> str:
    """``fusedenc.graphs.auto`` -> ``graphs``; a top-level module is its own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and SOURCES[module].name == "__init__.py") else module


def _layer_breaks(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    found = []
    for module, targets in graph.items():
        here = _folder(module)
        if module in TOP or module.endswith(".__main__"):  # entry points (python -m ...) reach any layer
            continue
        for target in targets:
            there = _folder(target)
            if there == here:
                continue
            if there in TOP or there not in layers or layers.index(there) > layers.index(here):
                found.append(f"{module} imports {target}")
    return sorted(found)


def test_every_module_lives_in_a_folder_of_the_layers():
    folders = {_folder(m) for m in SOURCES if m not in TOP}
    assert folders <= set(LAYERS), f"modules outside the layers' folders: {sorted(folders - set(LAYERS))}"
    assert {"common", "core", "ops", "fp8", "graphs", "hf", "lc0"} <= folders


def test_the_layer_check_finds_an_upward_import():
    graph = {"fusedenc.ops.gemm": {"fusedenc.core", "fusedenc.encoder.blocks"}, "fusedenc.core": {"fusedenc.common.dtypes"}}
    assert _layer_breaks(graph) == ["fusedenc.ops.gemm imports fusedenc.encoder.blocks"]


def test_folders_import_only_the_folders_below_them():
    breaks = _layer_breaks(_graph())
    assert breaks == [], f"imports pointing up the layers ({' < '.join(LAYERS)}): {breaks}"


def test_the_public_names_of_the_flat_layout_still_work():
    """The move into folders changed no public name: the modules users imported before it
    (documented in earlier READMEs) still give the same objects."""
    import fusedenc
    import fusedenc.auto_graphs
    import fusedenc.fp8
    import fusedenc.fp8_range
    import fusedenc.hf
    import fusedenc.ops
    import fusedenc.varlen
    from fusedenc.encoder import blocks
    from fusedenc.fp8 import range_check, rowwise
    from fusedenc.graphs import auto, runner
    from fusedenc.hf import patch
    from fusedenc.ops import gemm
    from fusedenc.varlen import packing

    assert fusedenc.auto_graphs.set_enabled is auto.set_enabled and fusedenc.auto_graphs.memory is auto.memory
    assert fusedenc.fp8_range.check_range is range_check.check_range
    assert fusedenc.fp8.quantize_rows is rowwise.quantize_rows and fusedenc.fp8.Calibration is rowwise.Calibration
    assert fusedenc.varlen.pack is packing.pack and fusedenc.varlen.Packing is packing.Packing
    assert fusedenc.ops.linear is gemm.linear is fusedenc.linear and fusedenc.ops.layer_norm is fusedenc.layer_norm
    assert fusedenc.hf.patch_hf is patch.patch_hf is fusedenc.patch_hf
    assert fusedenc.encoder.EncoderBlock is blocks.EncoderBlock is fusedenc.EncoderBlock
    assert fusedenc.graphs.GraphRunner is runner.GraphRunner is fusedenc.GraphRunner
