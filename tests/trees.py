"""Random module trees for property tests: nesting, no-split classes at several depths, ties across branches,
buffers (persistent, non-persistent, int, bool), zero-size modules, parameters directly on the root."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn

CLASS_NAMES = ["Block", "Layer", "Attn", "Mlp", "Norm", "Stack"]
_CLASSES = {name: type(name, (nn.Module,), {}) for name in CLASS_NAMES}


@st.composite
def module_trees(draw, max_depth: int = 3, max_children: int = 4):
    """(model, names of all its params) built on the meta device."""
    params: list[tuple[nn.Module, str, nn.Parameter]] = []

    def make(depth: int) -> nn.Module:
        cls = _CLASSES[draw(st.sampled_from(CLASS_NAMES))]
        module = cls()
        for i in range(draw(st.integers(0, 2))):
            numel = draw(st.sampled_from([0, 1, 16, 64, 256, 1024, 4096]))
            dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16]))
            p = nn.Parameter(torch.empty(numel, dtype=dtype, device="meta"))
            module.register_parameter(f"w{i}", p)
            params.append((module, f"w{i}", p))
        if draw(st.integers(0, 4)) == 0:
            dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.bool]))
            numel = draw(st.sampled_from([8, 64, 256]))
            module.register_buffer("buf", torch.empty(numel, dtype=dtype, device="meta"),
                                   persistent=draw(st.booleans()))
        if depth < max_depth:
            for i in range(draw(st.integers(0, max_children))):
                module.add_module(f"c{i}", make(depth + 1))
        return module

    root = make(0)
    if draw(st.booleans()):
        root.register_parameter("root_w", nn.Parameter(torch.empty(draw(st.sampled_from([4, 128])), device="meta")))
    # ties across branches: re-register an existing parameter object in another module
    for _ in range(draw(st.integers(0, 2))):
        if len(params) < 2:
            break
        src = draw(st.sampled_from(params))
        dst_module = draw(st.sampled_from(params))[0]
        if dst_module is not src[0]:
            name = f"tied{len(dst_module._parameters)}"
            dst_module.register_parameter(name, src[2])
    return root


@st.composite
def budgets(draw, total: int):
    """max_memory dicts with fractions of the model's size: one, two or three GPUs with RAM, a disk budget, RAM only,
    and the forms accelerate accepts without a ``"cpu"`` key (accelerators only, accelerators and disk, disk only)."""
    kind = draw(st.sampled_from(["gpu", "gpu2", "gpu3", "ram", "gpu-disk", "gpu-only", "gpu2-only", "gpu-disk-only",
                                 "disk-only"]))
    frac = lambda: int(total * draw(st.floats(0.0, 1.2)))  # noqa: E731
    if kind == "gpu":
        return {0: frac(), "cpu": frac()}
    if kind == "gpu2":
        return {0: frac(), 1: frac(), "cpu": frac()}
    if kind == "gpu3":
        return {0: frac(), 1: frac(), 2: frac(), "cpu": frac()}
    if kind == "gpu-disk":
        return {0: frac(), "cpu": frac(), "disk": frac()}
    if kind == "gpu-only":
        return {0: frac()}
    if kind == "gpu2-only":
        return {0: frac(), 1: frac()}
    if kind == "gpu-disk-only":
        return {0: frac(), "disk": frac()}
    if kind == "disk-only":
        return {"disk": frac()}
    return {"cpu": frac()}
