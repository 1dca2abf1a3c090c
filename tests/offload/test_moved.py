"""``allocator.offload.moved``: components that live in RAM, moved whole onto their device when they run (model
offload), at most one per device at a time, on the stand-in (tagged tensors: what a component computed with is seen)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from allocator import InvalidRuntime  # noqa: E402
from allocator.offload import StandInDevice  # noqa: E402
from allocator.offload.devices import on_stand_in  # noqa: E402
from allocator.offload.moved import ModelMoves, moves_of  # noqa: E402


class Tied(torch.nn.Module):
    """An embedding and a head sharing one weight, and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, ids):
        return self.head(self.embed(ids) * self.scale)


def _models():
    torch.manual_seed(0)
    return Tied().eval(), torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).eval()


def _bytes(model) -> int:
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def test_moved_components_compute_on_the_device_one_at_a_time():
    a, b = _models()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = b(a(ids))
    host = {n: p for n, p in a.named_parameters()}
    moves = ModelMoves(StandInDevice())
    moves.add("a", a, 0)
    moves.add("b", b, 0)
    with torch.no_grad():
        first = a(ids)
        assert on_stand_in(first) and all(on_stand_in(p) for p in a.parameters())
        assert a.head.weight is a.embed.weight                               # still one parameter
        got = b(first)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=0, atol=0)   # same weights, same ops
    assert moves.on == {0: "b"} and dict(moves.moves) == {"a": 1, "b": 1}
    assert not any(on_stand_in(p) for p in a.parameters())                   # sent back when b came
    assert {n: p for n, p in a.named_parameters()} == host                   # its very tensors in RAM
    assert moves.moved == _bytes(a) + _bytes(b)                              # the tied weight copied once
    with torch.no_grad():
        b(first)                                                             # already there: nothing moved
    assert moves.moved == _bytes(a) + _bytes(b) and moves.moves["b"] == 1
    moves.offload_all()
    assert moves.on == {} and not any(on_stand_in(p) for p in b.parameters())
    assert moves_of(a) is moves_of(b) is moves


def test_components_on_two_devices_stay_there_together():
    a, b = _models()
    moves = ModelMoves(StandInDevice())
    moves.add("a", a, 0)
    moves.add("b", b, 1)
    with torch.no_grad():
        b(a(torch.tensor([[1]])))
    assert moves.on == {0: "a", 1: "b"} and moves.moved == _bytes(a) + _bytes(b)


def test_without_a_stand_in_components_move_with_tensor_to():
    """On the CPU as the device the copies are ``Tensor.to``'s (the same tensors here); inputs are sent there."""
    a, _ = _models()
    moves = ModelMoves()
    hook = moves.add("a", a, "cpu")
    assert hook.execution_device == torch.device("cpu")
    with torch.no_grad():
        a(torch.tensor([[4]]))
    assert moves.on == {"cpu": "a"} and moves.moved == _bytes(a)


def test_a_component_with_hooks_or_quantized_tensors_is_refused():
    from accelerate.hooks import ModelHook, add_hook_to_module

    a, b = _models()
    add_hook_to_module(a, ModelHook())
    with pytest.raises(InvalidRuntime, match="has hooks already"):
        ModelMoves().add("a", a, 0)
    b[0].weight = torch.nn.Parameter(b[0].weight.to("meta"))
    with pytest.raises(InvalidRuntime, match="plain parameters in RAM"):
        ModelMoves().add("b", b, 0)


class Probe(torch.nn.Linear):
    """A linear layer that records whether each input it computes with is on the stand-in."""

    def forward(self, x):
        self.seen.append(on_stand_in(x))
        return super().forward(x)


class Decoder(torch.nn.Module):
    """A module whose ``decode`` calls its child directly, as ``AutoencoderKL.decode`` does (no ``forward``)."""

    def __init__(self):
        super().__init__()
        self.inner = Probe(4, 4)
        self.inner.seen = []

    def decode(self, x):
        return self.inner(x)

    def forward(self, x):
        return self.inner(x) * 2


def test_a_component_computed_on_the_cpu_takes_tensors_off_the_stand_in_and_gives_them_back():
    from allocator.offload.moved import CpuHook, compute_on_cpu

    torch.manual_seed(0)
    model, device = Decoder().eval(), StandInDevice()
    x = torch.randn(2, 4)
    with torch.no_grad():
        want, want_decoded = model(x), model.decode(x)
    model.inner.seen.clear()
    hook = compute_on_cpu("decoder", model, device)
    assert isinstance(hook, CpuHook) and isinstance(model.inner._hf_hook, CpuHook) and not model.inner._hf_hook.back
    with torch.no_grad():
        out = model(device.put(x))                 # inputs on the (stand-in) accelerator
        decoded = model.decode(device.put(x))     # through the child alone
    assert model.inner.seen == [False, False]      # the inputs it computed with were in RAM
    assert on_stand_in(out) and not on_stand_in(decoded)   # sent back by the module's hook; the child's stay
    torch.testing.assert_close(out.as_subclass(torch.Tensor), want, rtol=0, atol=0)
    torch.testing.assert_close(decoded, want_decoded, rtol=0, atol=0)
    assert not any(on_stand_in(p) for p in model.parameters()) and hook.calls == 1
    with pytest.raises(InvalidRuntime, match="has hooks already"):
        compute_on_cpu("decoder", model)
