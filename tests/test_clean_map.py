"""clean_device_map: accelerate's result, in linear time."""

import copy

from accelerate.utils.modeling import clean_device_map as accelerate_clean
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.placement import clean_device_map

names = st.lists(st.sampled_from(["a", "b", "c", "1", "10", "x"]), min_size=1, max_size=4).map(".".join)
maps = st.dictionaries(st.one_of(names, st.just("")), st.sampled_from([0, 1, "cpu", "disk"]), max_size=12)


@settings(max_examples=500, deadline=None)
@given(device_map=maps)
def test_same_as_accelerate(device_map):
    given_map = dict(device_map)
    assert clean_device_map(device_map) == accelerate_clean(copy.deepcopy(device_map))
    assert device_map == given_map


def test_linear_on_a_flat_map():
    device_map = {f"layers.{i}": 0 if i < 10_000 else "cpu" for i in range(20_000)}
    assert clean_device_map(device_map) == device_map
    assert clean_device_map({f"layers.{i}": 0 for i in range(20_000)}) == {"": 0}
