"""The ``mmfast`` package has no import circles, at module load or at run time.

The graph is built with ``ast`` from every module of the package: an edge ``a -> b``
is an import of mmfast module ``b`` anywhere in ``a`` -- at the top level or inside a
function (a lazy import is still a run-time edge). Imports under ``if TYPE_CHECKING:``
are not edges. Relative imports are resolved, and ``from pkg import name`` is an edge
to ``pkg.name`` when ``name`` is a submodule (otherwise to ``pkg``). Importing a
submodule also runs its parent packages' ``__init__``, so ``a -> pkg.sub`` adds
``a -> pkg`` too (unless ``a`` lives inside ``pkg``, which is loaded by then). A method
package whose ``__init__`` imports its submodules by name loads them all: an edge to
each. Any strongly connected component of more than one module fails the test with
the files in it.

Function-local imports are counted and held under a ceiling so they cannot grow
silently; lower the ceiling when the count drops.
"""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass, field
from pathlib import Path

import mmfast

LOG = logging.getLogger(__name__)

PACKAGE_DIR = Path(mmfast.__file__).resolve().parent
ROOT = "mmfast"

# The count of function-local imports of any module (mmfast or not) at the last change.
FUNCTION_LOCAL_IMPORT_CEILING = 200


@dataclass
class ImportGraph:
    modules: dict[str, Path]  # dotted module name -> file
    edges: dict[str, set[str]] = field(default_factory=dict)
    function_local_imports: int = 0


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(tree: ast.Module):
    """Yield ``(import node, inside a function)``, skipping ``if TYPE_CHECKING:`` bodies."""

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:  # the else branch runs
                    yield from visit_one(sub, in_function)
                continue
            yield from visit_one(child, in_function)

    def visit_one(node: ast.AST, in_function: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            return
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from visit(node, inner)

    yield from visit(tree, False)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The mmfast modules that executing ``node`` inside ``module`` loads."""
    if isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
        names: list[str] = []
    else:
        if node.level:
            package = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        bases = [base]
        names = [alias.name for alias in node.names]
    out: set[str] = set()
    for base in bases:
        if base != ROOT and not base.startswith(ROOT + "."):
            continue
        submodules = {f"{base}.{name}" for name in names if f"{base}.{name}" in known}
        out |= submodules
        if len(submodules) < len(names) or not names:
            out.add(base)  # a name defined in base (or `import base`)
    # Loading pkg.sub runs pkg/__init__ first -- unless pkg is a package the importer
    # lives in, which is already loaded (or loading) by then.
    own_packages = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
    implicit = {".".join(target.split(".")[:i]) for target in out for i in range(1, target.count(".") + 1)}
    return {t for t in out | (implicit - own_packages) if t in known and t != module}


def build_graph() -> ImportGraph:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    graph = ImportGraph(modules={_module_name(p): p for p in files})
    known = set(graph.modules)
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = graph.edges.setdefault(name, set())
        for node, in_function in _walk_imports(tree):
            if in_function:
                graph.function_local_imports += 1
            edges |= _targets(node, name, path.name == "__init__.py", known)
        edges |= _dynamic_targets(tree, name, known)
    return graph


def _dynamic_targets(tree: ast.Module, module: str, known: set[str]) -> set[str]:
    """Method discovery: a package ``__init__`` that imports its submodules with
    ``import_module(f"{__name__}.{m.name}")`` loads, when it is first imported, every public
    submodule but those it names in a ``not in (...)`` test -- so importing ``mmfast.decoding.base``
    loads every decoder.

    Not edges: :func:`mmfast.registry.load_plugins` importing the method packages by name. That is
    the registry's inversion (methods import the registry to register; the registry never imports a
    method module statically, and loads them only when a name is first looked up)."""
    skipped = {
        e.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.NotIn) for op in node.ops)
        for comparator in node.comparators
        if isinstance(comparator, (ast.Tuple, ast.List, ast.Set))
        for e in comparator.elts
        if isinstance(e, ast.Constant)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
        ):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.JoinedStr) and any(
            isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id == "__name__"
            for v in arg.values
        ):
            prefix = module + "."
            out.update(
                m
                for m in known
                if m.startswith(prefix)
                and "." not in m[len(prefix) :]
                and not m[len(prefix) :].startswith("_")
                and m[len(prefix) :] not in skipped
            )
    return {m for m in out if m in known and m != module}


def strongly_connected_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one node, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def _describe(graph: ImportGraph, component: list[str]) -> str:
    members = set(component)
    lines = [f"cycle of {len(component)} modules:"]
    for name in component:
        rel = graph.modules[name].relative_to(PACKAGE_DIR.parent)
        inside = sorted(graph.edges[name] & members)
        lines.append(f"  {rel} -> {', '.join(inside)}")
    return "\n".join(lines)


def test_no_import_cycles():
    graph = build_graph()
    cycles = strongly_connected_components(graph.edges)
    assert not cycles, "import cycles in mmfast:\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_function_local_imports_stay_under_ceiling():
    graph = build_graph()
    LOG.info("function-local imports in mmfast: %d", graph.function_local_imports)
    assert graph.function_local_imports <= FUNCTION_LOCAL_IMPORT_CEILING, (
        f"{graph.function_local_imports} function-local imports, ceiling {FUNCTION_LOCAL_IMPORT_CEILING}: "
        "import at the top of the module (a cycle is a design problem, not a reason to import lazily)"
    )


def test_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    """The checker itself: a lazy relative import closes a cycle, TYPE_CHECKING does not."""
    a = ast.parse(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import X\n"
        "def f():\n    from . import b\n    return b\n"
    )
    imports = list(_walk_imports(a))
    known = {"mmfast", "mmfast.pkg", "mmfast.pkg.a", "mmfast.pkg.b"}
    targets = set()
    for node, _in_function in imports:
        targets |= _targets(node, "mmfast.pkg.a", False, known)
    assert targets == {"mmfast.pkg.b"}
    assert [in_function for _, in_function in imports] == [False, False, True]  # __future__, typing, lazy
    assert strongly_connected_components({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert strongly_connected_components({"x": {"y"}, "y": set()}) == []


def test_graph_sees_method_discovery_and_known_edges():
    """A package that imports its submodules by ``f"{__name__}.{name}"`` loads them all (but the
    excluded ones); the real graph has the edges the layering relies on."""
    tree = ast.parse(
        "import importlib, pkgutil\nfor _m in pkgutil.iter_modules(__path__):\n"
        "    if not _m.name.startswith('_') and _m.name not in ('base', 'loop'):\n"
        "        importlib.import_module(f'{__name__}.{_m.name}')\n"
    )
    known = {"mmfast.d", "mmfast.d.base", "mmfast.d.loop", "mmfast.d.vcd", "mmfast.d._attn", "mmfast.d.vcd.x"}
    assert _dynamic_targets(tree, "mmfast.d", known) == {"mmfast.d.vcd"}
    graph = build_graph()
    assert "mmfast.decoding.vcd" in graph.edges["mmfast.decoding"]  # discovery
    assert "mmfast.pipeline" in graph.edges["mmfast.model"]  # MMModel.generate opens a session
    assert "mmfast.decoding" in graph.edges["mmfast.pruning._budget"]  # parent package __init__ runs
    assert "mmfast.eval.distributed" in graph.edges["mmfast.eval.runner"]
