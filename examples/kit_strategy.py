"""A new strategy from allocator.strategies.kit alone: first-fit decreasing, the largest groups seated first.

A strategy is an ordering: seating the largest groups first leaves the small ones to fill the gaps, so more of the
model tends to stay on the fastest tier than in model order. ``kit.fill`` does the rest, for every main device the
contract allows: accelerators in index order along the model, the streaming reserve raised or shrunk to what the
offloaded groups really stream, and accelerate's own map as a candidate (so the plan never keeps fewer bytes on the
accelerators than accelerate's).
"""

from allocator.strategies import kit


def decreasing(problem: kit.Problem) -> kit.Placement:
    groups = kit.tie_groups(problem)
    order = sorted(range(len(groups)), key=lambda k: -groups[k].size)   # largest first, model order on ties
    return kit.fill(problem, order, name="decreasing")
