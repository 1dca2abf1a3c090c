"""docs/schema.md writes out the plan's schema: every key ``Plan.to_dict`` writes (nested) is documented there, and
every documented key is written by some plan (one with a generation budget, accelerate's map with violations)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import allocator
from allocator.report.schema import SCHEMA

transformers = pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[2] / "docs" / "schema.md"
ROW = re.compile(r"^\| `([^`]+)` \|", re.MULTILINE)

#: Objects whose keys are names of the model, devices or steps, as the page writes them.
NAMED = {"device_map": "<module>", "budgets": "<device>", "resident": "<device>", "peak": "<device>",
         "parts": "<device>", "estimate.steps": "<step>", "hybrid.tokens": "<step>"}
#: Values documented as a whole (their inner keys are the model's tensor names, shapes, or another object's schema).
WHOLE = {"model.shapes", "experts", "compute", "runtime.experts", "runtime.expert_mode", "options.special_dtypes",
         "options.inputs", "options.profile", "options.expert_profile", "decisions[].facts"}


def paths(value, prefix: str = "") -> set[str]:
    """The dotted paths of ``value``'s keys, named keys as ``<device>`` and the like, list elements as ``[]``."""
    found = set()
    if isinstance(value, dict) and prefix not in WHOLE:
        for key, inner in value.items():
            name = NAMED.get(prefix, key)
            path = f"{prefix}.{name}" if prefix else name
            found |= {path} | paths(inner, path)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for inner in value:
            found |= paths(inner, f"{prefix}[]")
    return found


def documented() -> set[str]:
    return set(ROW.findall(DOC.read_text()))


@pytest.fixture(scope="module")
def written():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plans = [allocator.plan(model, {0: "600KiB", "cpu": "1GiB"}, generation=allocator.GenerationBudget(1, 64)),
             allocator.plan(model, {0: "500KiB", "cpu": "1GiB"}, strategy="sequential"),
             allocator.plan(model, {0: "600KiB", "cpu": "1GiB"}, runtime="allocator",
                            generation=allocator.GenerationBudget(1, 64))]
    assert any(p.violations for p in plans) and any(p.problem.generation for p in plans)
    return set().union(*(paths(p.to_dict()) for p in plans))


def test_every_key_to_dict_writes_is_documented(written):
    assert written - documented() == set()


def test_every_documented_key_is_written(written):
    assert documented() - written == set()


def test_the_page_names_this_schema():
    assert f"`{SCHEMA}`" in DOC.read_text() and f'"schema": "{SCHEMA}"' in DOC.read_text()
