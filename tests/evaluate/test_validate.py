import pytest
import torch
from torch import nn

import allocator
from allocator.errors import InvalidDeviceMap
from allocator.evaluate.validate import check


class Attn(nn.Module):
    """A module with direct parameters *and* children: its hook stays active while the children run."""

    def __init__(self):
        super().__init__()
        self.bias_table = nn.Parameter(torch.zeros(25))  # 100 B
        self.q = nn.Linear(5, 5)                         # 120 B
        self.register_buffer("index", torch.zeros(10, dtype=torch.int64))  # 80 B


class Net(nn.Module):
    _no_split_modules = ["Attn"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 5)   # 200 B
        self.attn = Attn()
        self.head = nn.Linear(5, 10, bias=False)  # 200 B
        self.head.weight = self.embed.weight


def kinds(model, device_map, max_memory, **kw):
    return sorted(v.kind for v in allocator.validate(model, device_map, max_memory, **kw))


def test_valid_map_and_exact_peaks():
    model = Net()
    p = allocator.build_problem(model, {0: 10_000, "cpu": 10_000})
    violations, memory = check(p, {"embed": 0, "head": 0, "attn": "cpu"})
    assert violations == []
    assert memory.main == 0
    # attn offloaded: its chain streams 100 (own) + 120 (q) at once; its buffer lives on the main device.
    assert memory.streamed == 220
    assert memory.peak[0] == 200 + 80 + 220
    assert memory.peak["cpu"] == 220
    assert memory.chain == ("attn", "attn.q")


def test_budget_violation_names_the_fix():
    found = allocator.validate(Net(), {"embed": 0, "head": 0, "attn": "cpu"}, {0: 499, "cpu": 1000})
    assert [v.kind for v in found] == ["budget"]
    assert "raise it by 1 B" in found[0].message and "attn" in found[0].message


def test_offload_buffers_moves_buffers_off_the_main_device():
    p = allocator.build_problem(Net(), {0: 10_000, "cpu": 10_000}, offload_buffers=True)
    _, memory = check(p, {"embed": 0, "head": 0, "attn": "cpu"})
    assert memory.peak[0] == 200 + 300 and memory.peak["cpu"] == 300


def test_cpu_main_streams_disk_weights_into_ram():
    p = allocator.build_problem(Net(), {"cpu": 10_000})
    _, memory = check(p, {"embed": "cpu", "head": "cpu", "attn": "disk"})
    assert memory.main == "cpu" and memory.peak["cpu"] == 200 + 80 + 220


def test_each_rule():
    model = Net()
    big = {0: 10_000, "cpu": 10_000}
    assert kinds(model, {"embed": 0, "attn": 0}, big) == ["coverage"]
    assert kinds(model, {"": 0, "nope": 0}, big) == []   # ignored by both loaders: a warning
    assert kinds(model, {"": 3}, big) == ["unknown-device"]
    assert kinds(model, {"embed": 0, "head": 0, "attn.q": "cpu", "attn.bias_table": 0, "attn.index": 0},
                 big) == ["no-split"]
    # a lone tensor offloaded is never loaded by accelerate's hooks
    assert kinds(model, {"embed": 0, "head": 0, "attn.q": 0, "attn.bias_table": "cpu", "attn.index": 0},
                 big) == ["no-split", "unhooked"]
    assert kinds(model, {"embed": 0, "head": 0, "attn.q": 0, "attn.bias_table": "cpu", "attn.index": 0}, big,
                 no_split_module_classes=[]) == ["no-split", "unhooked"]
    assert kinds(model, {"embed": 0, "head": "cpu", "attn": 0}, big) == ["tied"]


def test_malformed_maps_are_typed_errors():
    with pytest.raises(InvalidDeviceMap, match="dict"):
        allocator.validate(Net(), [("", 0)], {0: 1})
    with pytest.raises(InvalidDeviceMap, match="unknown device"):
        allocator.validate(Net(), {"": "gpu"}, {0: 1})


def test_single_device_map_has_no_hooks():
    p = allocator.build_problem(Net(), {"cpu": 10_000})
    _, memory = check(p, {"": "cpu"})
    assert memory.streamed == 0 and memory.peak == {"cpu": 500}


@pytest.mark.subprocess
def test_string_accelerator_spellings_make_the_main_device_depend_on_the_hash_seed():
    """accelerate's expression for the main device, run in fresh processes under several PYTHONHASHSEEDs, picks
    different accelerators for string spellings and always the lowest for integers; validate flags the first."""
    import os
    import subprocess
    import sys

    import torch.nn as nn

    import allocator

    expression = ("import sys; devices = {%s, 'cpu'}; print(list(devices - {'cpu', 'disk'})[0])")
    picks = {}
    for spelled in ("'cuda:1', 'cuda:0'", "1, 0"):
        picks[spelled] = {subprocess.run([sys.executable, "-c", expression % spelled], capture_output=True, text=True,
                                         env={**os.environ, "PYTHONHASHSEED": str(seed)}, check=True).stdout.strip()
                          for seed in range(12)}
    assert picks["'cuda:1', 'cuda:0'"] == {"cuda:0", "cuda:1"}   # the seed decides
    assert picks["1, 0"] == {"0"}
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    budget = {0: 10**6, 1: 10**6, "cpu": 10**6}
    kinds = [v.kind for v in allocator.validate(model, {"0": "cuda:1", "1": "cuda:0", "2": "cpu"}, budget)]
    assert kinds == ["main-device"]
    assert allocator.validate(model, {"0": 1, "1": 0, "2": "cpu"}, budget) == []
    assert allocator.validate(model, {"0": "cuda:1", "1": "cuda:0", "2": "cuda:0"}, budget) == []   # nothing offloaded
    assert allocator.validate(model, {"0": "cuda:0", "1": "cuda:0", "2": "cpu"}, budget) == []      # one accelerator
