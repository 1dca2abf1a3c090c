"""Issue #38: strategies and the judge record decisions as data; their sentences are made in ``report/decisions.py``."""

from __future__ import annotations

import json

from torch import nn

import allocator
from allocator.report.decisions import lines, sentence
from allocator.strategies import STRATEGIES

#: Kinds whose sentences are still written where the decision is made: ``not-main`` in ``report/minimum.py`` (the
#: report itself), ``pipeline`` in ``pipelines/plan.py``.
SAID_WHERE_MADE = {"not-main", "pipeline"}


def test_built_in_strategies_record_no_sentences_and_the_report_says_each():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    budgets = [{0: 40_000, 1: 40_000, "cpu": 10**6}, {0: 10**6, 1: 10**6}, {0: 20_000, 1: 60_000, "cpu": 10**6},
               {"cpu": 10**6}]
    kinds = set()
    for name in STRATEGIES:
        for budget in budgets:
            plan = allocator.plan(model, budget, strategy=name)
            for decision in plan.placement.decisions:
                kinds.add(decision.kind)
                if decision.kind in SAID_WHERE_MADE:
                    continue
                assert decision.text == "", (name, budget, decision)
                assert all(lines(decision)), (name, decision)
                assert not sentence(decision).startswith(f"{decision.kind} "), (name, decision)   # not the fallback
            data = plan.to_dict()
            assert [d["text"] for d in data["decisions"]] == [sentence(d) for d in plan.placement.decisions]
            again = allocator.Plan.from_dict(json.loads(json.dumps(data)), model)
            assert [sentence(d) for d in again.placement.decisions] == [d["text"] for d in data["decisions"]]
    assert {"assign", "full", "kept", "choice", "solver", "split", "peaks"} <= kinds, kinds
