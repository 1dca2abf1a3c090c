"""The package's import layout, read from the source with ``ast``: layers that only import downwards.

Three rules (issue #20, ../shared/STYLE.md):

- no import cycle between modules of ``allocator`` (module-level and function-level imports alike);
- no import of an ``allocator`` module inside a function (the way a cycle is hidden); optional third-party
  dependencies (torch, transformers, ortools, matplotlib, ...) may still be imported where they are used;
- no private name (``_name``) taken from another module of the package: ``from .x import _name``, ``x._name`` where
  ``x`` is a module of the package bound by an import, or a private module (``_x.py``) imported from outside its own
  package. What other modules need is public. (A private attribute of an object, ``cols._parents``, is not seen:
  that needs types.)

Imports under ``if TYPE_CHECKING:`` never run, so they are left out of the import graph (not of the private-name rule).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "allocator"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


@dataclass(frozen=True)
class Import:
    """One import of a module of the package, as written in ``source`` at ``line``."""

    source: str  # the importing module, e.g. "allocator.strategies.ilp"
    target: str  # the imported module, e.g. "allocator.evaluate.memory"
    names: tuple[str, ...]  # the names taken from it ("from target import names"); empty for "import target"
    line: int
    in_function: bool
    type_only: bool  # under ``if TYPE_CHECKING:``


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(module: str, level: int, target: str | None, modules: dict[str, Path]) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not _is_package(module, modules):
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool = False, type_only: bool = False):
    """Every import statement below ``node``, with whether it sits in a function or under ``TYPE_CHECKING``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function, type_only
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, True, type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)
        else:
            yield from _walk(child, in_function, type_only)


def imports(modules: dict[str, Path] | None = None) -> list[Import]:
    """Every import of a module of the package, in every module of the package.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, and of ``pkg`` otherwise (and of
    both when ``pkg`` is a package other than an ancestor of the importer: its ``__init__`` runs first). The package
    that contains the importer counts only when names are taken from it: Python imports it before the importer anyway.
    """
    modules = module_names() if modules is None else modules
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, in_function, type_only in _walk(tree):
            targets: list[tuple[str, tuple[str, ...]]] = []
            if isinstance(node, ast.Import):
                targets = [(alias.name, ()) for alias in node.names if alias.name.split(".")[0] == PACKAGE]
            else:
                base = _resolve(module, node.level, node.module, modules)
                if base.split(".")[0] != PACKAGE:
                    continue
                names = tuple(alias.name for alias in node.names)
                submodules = [name for name in names if f"{base}.{name}" in modules]
                targets = [(f"{base}.{name}", ()) for name in submodules]
                others = tuple(name for name in names if name not in submodules)
                if others or not (module.startswith(base + ".") or base == module):
                    targets.append((base, others))
            for target, names in targets:
                if target in modules and target != module:
                    found.append(Import(module, target, names, node.lineno, in_function, type_only))
    return found


def _graph(edges: list[Import]) -> dict[str, list[str]]:
    graph: dict[str, list[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge.target)
        graph.setdefault(edge.target, [])
    return graph


def cycles(edges: list[Import]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module, as a list of modules."""
    graph = _graph(edges)
    return [_one_cycle(graph, set(component)) for component in components(edges)]


def components(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph = _graph(edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _one_cycle(graph: dict[str, list[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``component``, found breadth first inside it."""
    start = min(component)
    parent = {start: None}
    queue = [start]
    for node in queue:
        for nxt in graph[node]:
            if nxt == start:
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [start] + path[::-1][1:] + [start]
            if nxt in component and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError("a strongly connected component without a cycle")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_attributes(modules: dict[str, Path] | None = None) -> list[str]:
    """``x._name`` where ``x`` is bound to another module of the package by an import in the same file."""
    modules = module_names() if modules is None else modules
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: dict[str, str] = {}
        for node, _, _ in _walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
            else:
                base = _resolve(module, node.level, node.module, modules)
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and bound[node.value.id] != module and _private(node.attr)):
                found.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return found


def _report(edges: list[Import]) -> str:
    return "\n".join(f"  {e.source}:{e.line} imports {e.target}" + (f" ({', '.join(e.names)})" if e.names else "")
                     for e in edges)


def test_the_reader_finds_the_package():
    modules = module_names()
    assert {"allocator", "allocator.api", "allocator.strategies", "allocator.strategies.sequential",
            "allocator.judge.witness"} <= set(modules)
    edges = imports(modules)
    assert any(e.source == "allocator.strategies.ilp" and e.target == "allocator.evaluate.memory" for e in edges)
    assert any(e.source == "allocator" and e.target == "allocator.api" for e in edges)


def test_the_cycle_finder_finds_a_cycle():
    def edge(a, b):
        return Import(a, b, (), 1, False, False)

    found = cycles([edge("a", "b"), edge("b", "c"), edge("c", "a"), edge("c", "d"), edge("d", "e")])
    assert found == [["a", "b", "c", "a"]]
    assert cycles([edge("a", "b"), edge("b", "c"), edge("a", "c")]) == []


def test_no_import_cycle():
    edges = [e for e in imports() if not e.type_only]
    graph = _graph(edges)
    lines = []
    for component in components(edges):
        cycle = _one_cycle(graph, set(component))
        lines.append(f"  {', '.join(component)} import each other, e.g. {' -> '.join(cycle)}:")
        steps = set(zip(cycle, cycle[1:]))
        lines.append(_report([e for e in edges if (e.source, e.target) in steps]))
    assert not lines, "import cycles in the package:\n" + "\n".join(lines)


def test_no_package_import_inside_a_function():
    inside = [e for e in imports() if e.in_function]
    assert not inside, ("modules of the package imported inside functions (import them at the top; if that makes a "
                        "cycle, move the shared rule down to the module that owns it):\n" + _report(inside))


def private_imports(edges: list[Import]) -> list[str]:
    """Private names taken from another module (``from .x import _name``), and private modules (``_x.py``) imported
    from outside the package that holds them."""
    found = []
    for e in edges:
        names = [n for n in e.names if _private(n)]
        if names:
            found.append(f"{e.source}:{e.line} takes {', '.join(names)} from {e.target}")
        package, _, leaf = e.target.rpartition(".")
        if _private(leaf) and not e.source.startswith(package + "."):
            found.append(f"{e.source}:{e.line} imports the private module {e.target} from outside {package}")
    return found


def test_the_private_name_rule_finds_each_form():
    def edge(source, target, *names):
        return Import(source, target, names, 1, False, False)

    found = private_imports([
        edge("allocator.api", "allocator.evaluate.validate", "check", "_fmt"),        # a private name
        edge("allocator.api", "allocator.strategies._fill", "fill"),         # a private module, from outside
        edge("allocator.strategies.backfill", "allocator.strategies._fill", "fill"),   # from inside: allowed
        edge("allocator.api", "allocator.evaluate.validate", "__all__"),              # a dunder is no private name
    ])
    assert found == ["allocator.api:1 takes _fmt from allocator.evaluate.validate",
                     "allocator.api:1 imports the private module allocator.strategies._fill from outside "
                     "allocator.strategies"]


def test_no_private_name_from_another_module():
    lines = [f"  {line}" for line in private_imports(imports()) + private_attributes()]
    assert not lines, "private names used across modules (make them public and documented):\n" + "\n".join(lines)


#: The layers of the package, bottom first, read from the folders: a subpackage is a layer's member with every module
#: in it; a module at the package top is named by itself. docs/architecture.md draws the same table. A module imports
#: only from its own layer or the ones below (and, within a layer, without a cycle: the test above).
LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": ("errors", "gc_pause", "memo", "logs", "budgets", "placement", "profile", "rules/"),
    "model": ("model/",),
    "problem": ("problem/",),
    "evaluate": ("evaluate/",),
    "search": ("search/",),
    "judge": ("judge/",),
    "strategies": ("strategies/",),
    "report": ("report/",),
    "composition": ("api", "fit", "offload/", "pipelines/", "integrations/", ""),
    "adapters": ("parallel/", "cli/", "__main__"),
}

#: At most this many modules at the package top (``__init__`` and ``__main__`` included), and none longer than
#: ``MAX_LINES``: the folders, not one flat list, show the architecture.
MAX_TOP = 12
MAX_LINES = 500


def layer_of(modules: dict[str, Path]) -> dict[str, int]:
    """The layer index of every module: a top module by its name, the modules of a subpackage by the folder
    (``""`` is the package itself)."""
    found = {}
    for index, names in enumerate(LAYERS.values()):
        for name in names:
            if name.endswith("/"):
                prefix = f"{PACKAGE}.{name[:-1]}"
                for module in modules:
                    if module == prefix or module.startswith(prefix + "."):
                        found[module] = index
            else:
                found[f"{PACKAGE}.{name}" if name else PACKAGE] = index
    return found


def test_every_module_sits_in_one_layer():
    modules = module_names()
    named = [name for names in LAYERS.values() for name in names]
    assert len(named) == len(set(named)), "a module is named in two layers"
    missing = sorted(set(modules) - set(layer_of(modules)))
    assert not missing, f"modules in no layer of tests/test_layout.py's LAYERS (and docs/architecture.md): {missing}"
    assert not sorted(set(layer_of(modules)) - set(modules)), "LAYERS names a module that does not exist"
    folders = {name[:-1] for names in LAYERS.values() for name in names if name.endswith("/")}
    assert folders == {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}, \
        "every subpackage of allocator is a member of one layer"


def test_imports_go_down_the_layers():
    modules = module_names()
    layer, names = layer_of(modules), list(LAYERS)
    upward = [e for e in imports(modules) if not e.type_only and layer.get(e.target, 0) > layer.get(e.source, 0)]
    assert not upward, "imports from a higher layer (move the shared rule down, or the importer up):\n" + "\n".join(
        f"  {e.source} ({names[layer[e.source]]}) imports {e.target} ({names[layer[e.target]]}) at line {e.line}"
        for e in upward)


def test_few_modules_at_the_top_and_none_too_long():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP, f"{len(top)} modules at the package top (at most {MAX_TOP}): {top}"
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


#: The modules of ``strategies/`` that are not strategies: the kit (what a caller's strategy is built from) and the
#: experts pass (a transform of a placement, applied by ``plan``), and ``auto``, the one strategy that composes others.
NOT_PROPOSERS = {"allocator.strategies", "allocator.strategies.kit", "allocator.strategies.experts"}
COMPOSER = "allocator.strategies.auto"


def strategy_imports(edges: list[Import]) -> list[str]:
    """Imports of one strategy module by another, but ``auto``'s: each strategy proposes from the building blocks
    (``search/``) and hands its candidates to the judge (``judge/``), and never runs another strategy."""
    strategies = {e.source for e in edges if e.source.startswith("allocator.strategies.")} - NOT_PROPOSERS
    targets = {e.target for e in edges if e.target.startswith("allocator.strategies.")} - NOT_PROPOSERS
    return [f"  {e.source} imports {e.target} at line {e.line}" for e in edges
            if e.source in strategies - {COMPOSER} and (e.target in targets or e.target == "allocator.strategies"
                                                         and set(e.names) & {n.rsplit(".", 1)[-1] for n in targets})]


def test_the_strategy_import_rule_finds_one():
    edges = [Import("allocator.strategies.ilp", "allocator.strategies.reserve", (), 3, False, False),
             Import("allocator.strategies.balanced", "allocator.strategies", ("reserve",), 4, False, False),
             Import("allocator.strategies.auto", "allocator.strategies.ilp", (), 5, False, False)]
    assert [line.split()[0] for line in strategy_imports(edges)] == ["allocator.strategies.ilp",
                                                                     "allocator.strategies.balanced"]


def test_no_strategy_imports_another():
    found = strategy_imports(imports())
    assert not found, "a strategy imports another (propose from search/, judge with judge/; only auto composes):\n" \
        + "\n".join(found)


#: The modules that may call the validator (``allocator.evaluate.validate.check``), issue #38: its own module
#: (``validate()``) and the judge's one door to it (``judge/verdict.py``: every other module, the experts pass
#: included, judges maps there with ``judged``, ``violations``, ``is_valid``, ``memory``).
VALIDATOR = "allocator.evaluate.validate"
CHECKERS = {VALIDATOR, "allocator.judge.verdict"}


def check_callers(sources: dict[str, str], modules: dict[str, Path]) -> dict[str, int]:
    """The modules of ``sources`` (module name -> source) that call ``check`` of the validator, with how many calls:
    ``check(...)`` under any name it is imported as, and ``v.check(...)`` where ``v`` names the validator module."""
    found = {}
    for name, source in sources.items():
        tree = ast.parse(source)
        names, modules_as = ({"check"} if name == VALIDATOR else set()), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(name, node.level, node.module, modules)
                if target == VALIDATOR:
                    names |= {a.asname or a.name for a in node.names if a.name == "check"}
                elif target == VALIDATOR.rpartition(".")[0]:
                    modules_as |= {a.asname or a.name for a in node.names if a.name == "validate"}
            elif isinstance(node, ast.Import):
                modules_as |= {a.asname for a in node.names if a.name == VALIDATOR and a.asname}
        calls = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call) and (
            isinstance(node.func, ast.Name) and node.func.id in names
            or isinstance(node.func, ast.Attribute) and node.func.attr == "check"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in modules_as))
        if calls:
            found[name] = calls
    return found


def test_the_check_caller_rule_finds_each_form():
    modules = module_names()
    sources = {"allocator.strategies.ilp": "from ..evaluate.validate import check as judge\njudge(p, m)\n",
               "allocator.report.plan": "from ..evaluate import validate\nvalidate.check(p, m)[0]\n",
               "allocator.fit": "from .evaluate.validate import check\nx = [check(p, a), check(p, b)]\n",
               "allocator.api": "from .judge.verdict import is_valid\nis_valid(p, m)\ncheck = 1\n"}
    assert check_callers(sources, modules) == {"allocator.strategies.ilp": 1, "allocator.report.plan": 1,
                                               "allocator.fit": 2}


def test_check_is_called_from_the_validator_and_the_judge_only():
    modules = module_names()
    found = check_callers({name: path.read_text() for name, path in modules.items()}, modules)
    assert set(found) <= CHECKERS and len(found) <= 2, (
        "check() is called outside the judge's door (allocator/judge/verdict.py: judged, violations, is_valid, "
        f"memory): {sorted(set(found) - CHECKERS)}")


def check_importers(edges: list[Import]) -> list[str]:
    """The modules that import the validator's ``check``, or the validator module whole (through which they could
    call it under any name)."""
    return sorted({e.source for e in edges if e.target == VALIDATOR and ("check" in e.names or not e.names)})


def test_the_check_importer_rule_finds_each_form():
    edges = [Import("allocator.strategies.experts", VALIDATOR, ("check",), 1, False, False),
             Import("allocator.report.plan", VALIDATOR, (), 2, False, False),           # import the module whole
             Import("allocator.judge.contract", VALIDATOR, ("Violation", "format_bytes"), 3, False, False)]
    assert check_importers(edges) == ["allocator.report.plan", "allocator.strategies.experts"]


def test_only_the_judge_imports_check():
    found = check_importers(imports())
    assert set(found) <= CHECKERS - {VALIDATOR} and len(found) <= 1, (
        "modules import the validator's check outside the judge's door (import judged, violations, is_valid or "
        f"memory from allocator/judge/verdict.py): {sorted(set(found) - CHECKERS)}")
