"""Where a map keeps bytes: the fastest tier, and the accelerators along the model (rules 2 and 3 of the contract
read these; :mod:`allocator.judge.contract` states the rules).

Notes
-----
:func:`pulled` is made once per problem (O(tensors of tie groups)); :func:`accelerator_sequence` is O(runs · log
tensors).
"""

from __future__ import annotations

import bisect

import numpy as np

from ..memo import Key
from ..budgets import Budgets, Device, is_accelerator
from ..problem import Problem
from .runs import Run, columns
from .units import problem_groups
from .validate import Violation

__all__ = ["accelerator_sequence", "fast_bytes", "fast_tier", "order_violations", "pulled"]

PULLED = Key("pulled")


def fast_tier(budgets: Budgets) -> frozenset:
    """The devices of the fastest tier: the accelerators, or RAM when there are none."""
    return frozenset(budgets.accelerators) or frozenset({"cpu"})


def fast_bytes(problem: Problem, found: list[Run]) -> int:
    """Counted bytes that runs of a map keep on the fastest tier (:func:`fast_tier`)."""
    fast = fast_tier(problem.budgets)
    counted = columns(problem.graph).sum_counted
    return sum(counted[run.end] - counted[run.start] for run in found if run.device in fast)


def pulled(problem: Problem) -> list[int]:
    """Sorted tensor indices that sit with a tie: the tensors of every unit of a tie group but its first (a tied
    ``lm_head``, BERT's decoder and the bias it shares go where the embeddings are). Made once per problem."""
    def build():
        found = problem_groups(problem)
        counts = found.counts()
        if not len(counts) or counts.max() < 2:
            return []
        members, start = found.array("members"), found.array("start")
        later = np.zeros(len(members), dtype=bool)
        for k in np.flatnonzero(counts > 1).tolist():
            later[members[start[k] + 1:start[k] + counts[k]]] = True
        keep, lo, hi, _ = found.units.spans(problem.graph)
        chosen = later[keep]
        return sorted({t for a, b in zip(lo[chosen].tolist(), hi[chosen].tolist()) for t in range(a, b)})

    return problem.derived.once(PULLED, build)


def accelerator_sequence(problem: Problem, found: list[Run]) -> list[Device]:
    """The accelerators of the runs of a map in model order, runs made only of tied second names left out."""
    tied = pulled(problem)
    out = []
    for run in found:
        if not is_accelerator(run.device) or run.device is None:
            continue
        inside = bisect.bisect_left(tied, run.end) - bisect.bisect_left(tied, run.start) if tied else 0
        if tied and inside == run.end - run.start:
            continue
        out.append(run.device)
    return out


def order_violations(problem: Problem, found: list[Run]) -> list[Violation]:
    """Rule 2 of the contract: a resident unit on a lower-index accelerator after one on a higher index."""
    sequence = accelerator_sequence(problem, found)
    rank = {d: i for i, d in enumerate(problem.budgets.accelerators)}
    top = None
    for device in sequence:
        if device not in rank:
            continue
        if top is not None and rank[device] < rank[top]:
            return [Violation("contract-order", f"accelerator {device!r} holds a unit that runs after units on "
                              f"accelerator {top!r}: accelerators must be used in index order along the model "
                              "(objective='latency' allows any order).")]
        top = device if top is None or rank[device] > rank[top] else top
    return []
