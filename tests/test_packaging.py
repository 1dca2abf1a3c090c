"""pyproject's requirements: lower bounds where the code needs them, no upper caps (they block users' upgrades)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.match(r"[A-Za-z0-9_.-]+", s).group(0).lower(): s for s in specs}


def test_no_upper_version_caps():
    capped = [s for s in _requirements().values() if re.search(r"<|~=|==", s)]
    assert not capped, capped


def test_lower_bounds_the_code_relies_on():
    requirements = _requirements()
    assert requirements["accelerate"] == "accelerate>=1.15"  # sequential reproduces 1.15's algorithm
    assert requirements["transformers"] == "transformers>=5"  # _get_device_map, DynamicCache(config=...)
    assert requirements["torch"] == "torch>=2.1"


def test_requires_python_is_the_oldest_that_runs_the_code():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"  # dataclass(weakref_slot=True) raises TypeError on 3.10
