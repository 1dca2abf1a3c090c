"""Differential property test: strategy="sequential" gives accelerate's map on random module trees."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import allocator
from allocator.errors import UnsupportedByAccelerate
from allocator.runtime import main_device
from allocator.validate import check
from parity import both
from trees import budgets, module_trees

KINDS = {"coverage", "unknown-key", "unknown-device", "no-split", "tied", "unhooked", "budget"}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sequential_equals_accelerate_on_random_trees(data):
    model = data.draw(module_trees())
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    max_memory = data.draw(budgets(max(total, 1)))
    kwargs = dict(
        no_split_module_classes=data.draw(st.sampled_from([None, ["Block"], ["Layer", "Attn"]])),
        offload_buffers=data.draw(st.booleans()),
        clean_result=data.draw(st.booleans()),
        fallback_allocation=data.draw(st.booleans()),
    )
    before = dict(max_memory)
    theirs, ours, problem = both(model, max_memory, **kwargs)
    assert max_memory == before
    if isinstance(theirs, type):
        assert isinstance(ours, UnsupportedByAccelerate), f"accelerate raised {theirs.__name__}, we returned {ours}"
        return
    assert ours == theirs
    # Every map goes through the one validator; accelerate's own violations are recorded, not hidden.
    violations, memory = check(problem, ours)
    assert all(v.kind in KINDS for v in violations)
    assert memory.main == main_device(ours.values())
