"""A new strategy from allocator.strategies.kit alone: first fit in model order, the largest groups seated first.

Seating the largest groups first leaves the small ones to fill the gaps (first-fit decreasing), so more of the model
tends to stay on the fastest tier than in model order. Under every main device the kit offers, the streaming reserve
is shrunk to what the offloaded groups really stream and the fill redone; the cost model picks among the fills and
accelerate's own map (so the plan never keeps fewer bytes on the accelerators than accelerate's).
"""

from allocator.strategies import kit


def decreasing(problem: kit.Problem) -> kit.Placement:
    groups = kit.tie_groups(problem)
    order = sorted(range(len(groups)), key=lambda k: -groups[k].size)   # largest first, model order on ties
    candidates = [("accelerate", lambda: kit.accelerate_placement(problem))]
    for main in kit.main_candidates(problem):
        reserve = max((g.stream for g in groups if not g.resident_only), default=0)
        for _ in range(4):   # shrink the reserve to what the offloaded groups stream
            seats = fill(problem, groups, order, main, reserve)
            if seats is None:
                break
            placed = kit.device_map(problem, groups, seats)
            name = f"decreasing, main {main!r}, reserve {reserve} B"
            candidates.append((name, lambda placed=placed: kit.Placement(placed, "decreasing")))
            offloaded = [g.stream for g, d in zip(groups, seats) if d in ("cpu", "disk") and d != main]
            if max(offloaded, default=0) == reserve:
                break
            reserve = max(offloaded, default=0)
    return kit.best_valid(problem, candidates)


def fill(problem, groups, order, main, reserve):
    """A device per group (in group order), or None when one fits nowhere. Accelerators stay in index order along
    the model: a group never goes to an accelerator before one an earlier group went to, nor after a later one's."""
    room = kit.Room.of(problem, main, reserve, groups)
    if room is None:
        return None
    seats: list = [None] * len(groups)
    for k in order:
        before = [room.devices.index(d) for d in seats[:k] if d is not None and not room.targets[room.devices.index(d)]]
        after = [room.devices.index(d) for d in seats[k:] if d is not None and not room.targets[room.devices.index(d)]]
        j = room.seat_group(groups[k], low=max(before, default=0), high=min(after, default=None))
        if j < 0:
            return None
        seats[k] = room.devices[j]
    return seats
