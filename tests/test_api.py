"""The public entry points' user-facing surface: ``repr(Plan)`` and ``infer_auto_device_map(verbose=True)``."""

from __future__ import annotations

import functools

import allocator
from allocator import zoo
from allocator.validate import _fmt


@functools.cache
def _segformer():
    model = zoo.build("segformer-b0")
    return model, allocator.build_problem(model, {"cpu": 0}).graph.total


def test_plan_repr_is_one_short_line():
    model, total = _segformer()
    p = allocator.plan(model, {0: int(0.6 * total), "cpu": 2 * total})
    text = repr(p)
    assert "\n" not in text and len(text) < 300, text  # the dataclass repr of the whole Problem ran to 11-16k
    assert text.startswith(f"<Plan {p.strategy} for SegformerForSemanticSegmentation: main device 0, "
                           f"estimated {p.cost.seconds * 1e3:.3f} ms per forward, valid; ")
    assert f"0: resident {_fmt(p.resident(0))}, peak {_fmt(p.peak[0])} of {_fmt(int(0.6 * total))}" in text
    assert f"cpu: resident {_fmt(p.resident('cpu'))}" in text
    assert str(p) == text


def test_plan_repr_counts_violations():
    model, total = _segformer()
    p = allocator.plan(model, {0: int(0.15 * total), 1: int(0.15 * total), "cpu": 2 * total}, strategy="sequential")
    assert p.violations and f"{len(p.violations)} violation(s)" in repr(p)
