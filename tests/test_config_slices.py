"""The options per concern (issue #38): each layer below the composition reads the slice of its concern from the
problem (``problem.cost.optimize``, ``problem.runtime.prefetch``), never the whole ``PlanOptions``; every option
lives in one slice; slices are made once per problem, frozen, and made anew with other options."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch.nn as nn

from allocator.problem import OPTION_NAMES, PlanOptions, build_problem
from allocator.problem.slices import SLICES, option_of

#: The modules that may read ``PlanOptions`` itself: where the options are defined, checked and sliced
#: (``problem/``), the composition that takes them from the caller (``api``, ``fit``, ``integrations/``), the saved
#: plan that writes all of them (``report/schema``) and the command line that makes them (``cli/``).
READERS = ("allocator.problem", "allocator.api", "allocator.fit", "allocator.integrations", "allocator.report.schema",
           "allocator.cli")

#: ``PlanOptions.generation`` is a slice of its own (a ``GenerationBudget``), read where the problem is built.
OWN_SLICE = {"generation"}


ROOT = Path(__file__).resolve().parents[1] / "allocator"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def allowed(module: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in READERS)


def option_reads(source: str) -> list[tuple[int, str]]:
    """``x.options`` anywhere (``problem.options``, ``plan.problem.options``, ``getattr(p.options, ...)``), and
    ``options.<field>`` / ``opts.<field>`` of a ``PlanOptions`` field, with their lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr == "options":
            found.append((node.lineno, f"{ast.unparse(node)}"))
        elif (isinstance(node.value, ast.Name) and node.value.id in ("options", "opts")
              and node.attr in set(OPTION_NAMES) | {"contract"}):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_rule_finds_each_form():
    source = ("def f(problem, plan, options):\n"
              "    a = problem.options.loader\n"
              "    b = plan.problem.options\n"
              "    c = getattr(problem.options, 'dtype')\n"
              "    d = options.offload_buffers\n"
              "    e = problem.placing.loader, problem.runtime.prefetch, options_of(problem)\n")
    assert [line for line, _ in option_reads(source)] == [2, 3, 4, 5]


def test_no_module_below_the_composition_reads_the_whole_options():
    found = [f"  {module}:{line}: {text}" for module, path in modules().items() if not allowed(module)
             for line, text in option_reads(path.read_text())]
    assert not found, ("modules that read PlanOptions instead of the problem's slice of their concern "
                       "(problem.reading / placing / deciding / cost / runtime, allocator/problem/slices.py):\n"
                       + "\n".join(found))


def test_every_option_lives_in_one_slice():
    homes: dict[str, list[str]] = {}
    for name, kind in SLICES.items():
        for f in dataclasses.fields(kind):
            homes.setdefault(option_of(f), []).append(f"{name}.{f.name}")
    assert set(OPTION_NAMES) - OWN_SLICE <= set(homes), sorted(set(OPTION_NAMES) - OWN_SLICE - set(homes))
    assert set(homes) <= set(OPTION_NAMES) | {"contract"}, sorted(set(homes) - set(OPTION_NAMES))
    assert {k: v for k, v in homes.items() if len(v) > 1} == {}


def test_slices_are_made_once_frozen_and_anew_with_other_options():
    options = PlanOptions(runtime="allocator", prefetch=2, objective="latency", offload_buffers=True,
                          loader="accelerate", strict=True)
    problem = build_problem(nn.Linear(4, 4), {"cpu": 10**6}, options=options)
    assert problem.runtime is problem.runtime and problem.cost is problem.cost
    assert (problem.runtime.name, problem.runtime.prefetch) == ("allocator", 2)
    assert (problem.deciding.contract, problem.deciding.strict) == (False, True)
    assert (problem.placing.loader, problem.placing.offload_buffers) == ("accelerate", True)
    assert not problem.cost.measured and problem.reading.dtype == problem.options.dtype
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.runtime.prefetch = 3
    deeper = problem.with_options(prefetch=0, objective="contract")
    assert (deeper.runtime.prefetch, deeper.deciding.contract) == (0, True)
    assert deeper.graph is problem.graph and problem.runtime.prefetch == 2   # the first problem is unchanged
    assert dataclasses.replace(problem, options=options).runtime == problem.runtime
