"""What an ``InfeasiblePlacement`` from :func:`allocator.plan` promises, checked where a property test meets one
(instead of returning: a test that gives up on the error cannot fail when the error is wrong)."""

from __future__ import annotations

import allocator

#: Strategies seen to plan at a smaller budget where the given one fails (under the contract, accelerate's floor moves
#: with the budgets; ``auto`` and ``ilp`` also run a time-boxed CP-SAT; the kit example is first fit decreasing): the
#: minimum their error states can lie at or below the given budget (where "raise it to at least that" is no advice),
#: and 1 % under it can plan again where the search did not look (below the given budget or a failed doubling). The
#: minimum_ram_error search makes 1 % less fail with RAM as the only budget.
NOT_MONOTONE = {"auto", "ilp", "decreasing"}


def _plans(model, budget, **kwargs) -> bool:
    try:
        return allocator.plan(model, budget, strict=True, **kwargs).valid
    except allocator.InfeasiblePlacement:
        return False


def assert_true_minimum(err: allocator.InfeasiblePlacement, model, budget: dict, **kwargs) -> None:
    """``err`` (raised by ``plan(model, budget, strict=True, **kwargs)``) states a minimum that is one: with
    ``err.minimum`` bytes on ``err.device`` (the other budgets unchanged) the plan is valid; but for the strategies in
    :data:`NOT_MONOTONE` (with RAM alone, for them too) 1 % less (at least a byte) fails and the minimum lies above
    the given budget. Without a minimum, the strategy fails even with 1 TiB there (RAM, or the first accelerator
    where the budget names no RAM)."""
    strategy = kwargs.get("strategy", "auto")
    name = strategy if isinstance(strategy, str) else strategy.__name__
    if err.minimum is None:
        accelerators = sorted(d for d in budget if d not in ("cpu", "disk"))
        device = "cpu" if "cpu" in budget or not accelerators else accelerators[0]
        assert not _plans(model, {**budget, device: 2**40}, **kwargs), f"{name}: {err} (but 1 TiB on {device} plans)"
        return
    device, minimum, given = err.device, err.minimum, budget.get(err.device) or 0
    assert _plans(model, {**budget, device: minimum}, **kwargs), f"{name}: {minimum} B on {device!r} does not plan"
    less = minimum - max(1, minimum // 100)
    if minimum > 0 and (name not in NOT_MONOTONE or set(budget) == {"cpu"}):
        assert not _plans(model, {**budget, device: less}, **kwargs), f"{name}: {less} B on {device!r} plans too"
    if name not in NOT_MONOTONE:
        assert minimum > given, f"{name}: the minimum {minimum} B on {device!r} is not above {budget}"
