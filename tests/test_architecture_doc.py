"""docs/architecture.md stays true to the code: every module it names exists, and every module is named there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def named() -> set[str]:
    return set(re.findall(r"`(allocator/[\w/]*(?:\.py)?)`", DOC.read_text()))


def test_every_module_the_document_names_exists():
    missing = sorted(path for path in named() if not (ROOT / path).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_named_in_the_document():
    paths = named()
    folders = {p for p in paths if p.endswith("/")}
    modules = [str(p.relative_to(ROOT)) for p in (ROOT / "allocator").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")]
    unnamed = sorted(m for m in modules if m not in paths and not any(m.startswith(f) for f in folders))
    assert not unnamed, f"modules docs/architecture.md does not place in a layer: {unnamed}"
    assert len(paths) > 40


def test_the_document_walks_the_composition():
    text = DOC.read_text()
    api = (ROOT / "allocator" / "api.py").read_text()
    for step in ("build_problem", "witness", "_placed", "_check_rules_and_contract", "finish"):
        assert step in api and step in text, step


def tasks() -> dict[str, list[str]]:
    """The newcomer tasks of the document's table: task -> the files it says to touch (its second column)."""
    text = DOC.read_text().split("## Newcomer tasks", 1)[1]
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and not line.startswith("| task")]
    return {row[0].strip("| "): re.findall(r"`((?:allocator|docs|tests)/[\w/<>]*\.(?:py|md))`", row[1])
            for row in rows if len(row) >= 3}


#: The row counted on today's code, before a model family sits behind one interface (issue #46): the lead updates it,
#: and this exemption goes, when that interface lands.
TODAY = "a model family"


def test_each_newcomer_task_names_three_files_or_fewer_and_they_exist():
    found = tasks()
    assert set(found) == {"a strategy", "a runtime rule for a new accelerate release", "a cost term", TODAY}, found
    for task, files in found.items():
        assert 1 <= len(files) <= (len(files) if task == TODAY else 3), (task, files)
        for name in files:
            path = ROOT / name
            assert (path.parent.is_dir() if "<name>" in name else path.is_file()), (task, name)


def test_a_registered_strategy_is_cleaned_and_judged_like_a_callable(monkeypatch):
    """The strategy row's promise: registered in ``STRATEGIES`` (the one place the table names), a stranger's
    strategy gets what a callable gets from ``allocator.plan``: its map cleaned as the options say, and the contract
    judged (it is exempt from nothing, whatever it claims)."""
    import pytest
    from torch import nn

    import allocator
    from allocator.placement import CONTRACT_RULES, Placement
    from allocator.strategies import STRATEGIES

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    budget = {0: 10**6, 1: 10**6, "cpu": 10**6}

    def stranger(problem):   # every unit on accelerator 0, unmerged, and claiming accelerate's exemptions
        return Placement({str(k): 0 for k in range(4)}, "stranger", exempt=CONTRACT_RULES)

    def backwards(problem):  # breaks the contract's index order
        return Placement({"0": 1, "1": 1, "2": 0, "3": 0}, "backwards", exempt=CONTRACT_RULES)

    monkeypatch.setitem(STRATEGIES, "stranger", stranger)
    monkeypatch.setitem(STRATEGIES, "backwards", backwards)
    registered, given = allocator.plan(model, budget, strategy="stranger"), allocator.plan(model, budget,
                                                                                          strategy=stranger)
    assert registered.device_map == given.device_map == {"": 0}   # cleaned
    assert registered.placement.exempt == given.placement.exempt == frozenset()
    for strategy in ("backwards", backwards):
        with pytest.raises(allocator.BrokenContract):
            allocator.plan(model, budget, strategy=strategy)
