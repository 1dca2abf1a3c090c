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
