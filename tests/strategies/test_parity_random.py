"""Differential property tests: strategy="sequential" gives accelerate's map on random module trees (and flat
stacks, where it takes entries a stretch at a time)."""

import contextlib
import copy
import random
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import allocator
from allocator.evaluate import kernels
from allocator.errors import UnsupportedByAccelerate
from allocator.evaluate.memory import main_device
from allocator.evaluate.validate import check
from parity import both
from trees import budgets, module_trees

KINDS = {"coverage", "unknown-key", "unknown-device", "no-split", "tied", "unhooked", "budget"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sequential_equals_accelerate_on_random_trees(data):
    same_as_accelerate(data, data.draw(module_trees()))


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sequential_by_stretches_equals_accelerate(data):
    # entries that fit one after another are taken a stretch at a time from kernels.NUMPY_FROM queued entries on;
    # here from the first, with stretches as short as one entry
    model = data.draw(st.one_of(module_trees(), st.builds(flat_stack, st.integers(1, 60), st.randoms())))
    with stretches(data.draw(st.sampled_from([1, 2, 4, 64]))):
        same_as_accelerate(data, model)


def test_sequential_equals_accelerate_on_a_long_flat_stack():
    # past kernels.NUMPY_FROM with the defaults: stretches end where a device fills and where the largest layer is taken
    model = flat_stack(1500, random.Random(0))
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    for max_memory in ({0: total // 3, 1: total // 4, "cpu": total // 5}, {"cpu": total // 2}):
        theirs, ours, _ = both(model, max_memory, no_split_module_classes=["Block"])
        assert ours == theirs and len(set(ours.values())) > 1


@pytest.mark.parametrize("stretch", [1, 3, 64])
def test_sequential_by_stretches_equals_accelerate_at_every_margin(stretch):
    # stretches of several lengths against accelerate with the device boundaries swept over every layer, the largest
    # layer taken and recomputed inside stretches
    model = nn.Sequential(*[Block(w, 0) for w in (8, 4, 1, 1, 4, 1, 2, 8, 1, 1, 2, 1)])
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    with stretches(stretch):
        for room in range(total // 4, 2 * total, 8):
            for max_memory in ({0: room, "cpu": total}, {0: room // 2, 1: room, "cpu": total}):
                theirs, ours, _ = both(model, max_memory, no_split_module_classes=["Block"])
                assert ours == theirs, max_memory


@contextlib.contextmanager
def stretches(first: int):
    """Numpy paths from the first entry on, stretches of ``first`` entries at first."""
    with mock.patch.object(kernels, "NUMPY_FROM", 0), mock.patch.object(kernels.Stretches, "FIRST", first), \
            mock.patch.object(kernels.Stretches, "SHORT", max(first // 4, 1)):
        yield


class Block(nn.Module):
    def __init__(self, width: int, buffer: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        if buffer:
            self.register_buffer("b", torch.zeros(buffer))


def flat_stack(layers: int, rng: random.Random) -> nn.Module:
    """Layers of a few sizes (so that several share the largest), some with a buffer."""
    widths = [rng.choice([1, 2, 4, 8]) for _ in range(3)]
    return nn.Sequential(*[Block(rng.choice(widths), rng.choice([0, 0, 3])) for _ in range(layers)])


def snapshot(model: nn.Module) -> dict:
    """What planning must leave as it was: each tensor (the object, its storage, dtype, device, values), the modules'
    training flags, hooks and attributes."""
    tensors = {k: (id(v), v.data_ptr(), v.dtype, v.device, v.shape, v.requires_grad,
                   None if v.is_meta else v.detach().tolist())
               for k, v in model.state_dict(keep_vars=True).items()}
    modules = {n: (m.training, len(m._forward_hooks), len(m._forward_pre_hooks), sorted(vars(m)))
               for n, m in model.named_modules()}
    return {"tensors": tensors, "modules": modules}


def same_as_accelerate(data, model):
    total = allocator.build_problem(model, {"cpu": 0}).graph.total
    max_memory = data.draw(budgets(max(total, 1)))
    kwargs = dict(
        no_split_module_classes=data.draw(st.sampled_from([None, ["Block"], ["Layer", "Attn"]])),
        offload_buffers=data.draw(st.booleans()),
        clean_result=data.draw(st.booleans()),
        fallback_allocation=data.draw(st.booleans()),
    )
    before, state, given = dict(max_memory), snapshot(model), copy.deepcopy(kwargs)
    theirs, ours, problem = both(model, max_memory, **kwargs)   # ours is handed this very dict, and this model
    assert max_memory == before and snapshot(model) == state and kwargs == given
    if isinstance(theirs, type):
        assert isinstance(ours, UnsupportedByAccelerate), f"accelerate raised {theirs.__name__}, we returned {ours}"
        return
    assert ours == theirs
    # Every map goes through the one validator; accelerate's own violations are recorded, not hidden.
    violations, memory = check(problem, ours)
    assert all(v.kind in KINDS for v in violations)
    assert memory.main == main_device(ours.values())
