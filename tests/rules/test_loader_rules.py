"""The loader rules (:mod:`allocator.rules`), one row each, against real loads on both paths.

Each row is a small random transformers model saved to disk (persistent buffers saved with values that differ from
their ``__init__`` ones, so a loader that never reads them shows), a device map (CPU main device, some of it on disk)
and, per loading path, whether the measured load works and computes what the fully-in-RAM model computes. For every
row and path the test loads the model (``from_pretrained`` for ``loader="transformers"``,
``init_empty_weights`` + ``load_checkpoint_and_dispatch`` for ``loader="accelerate"``), runs a forward and compares
the outputs: ``validate(..., loader=...)`` must say valid exactly when that works, and where it works the offloaded
weights the hooks hold at once (measured by wrapping them, :class:`models.StreamMeter`) fit the predicted streaming
reserve.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import SafetensorError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import allocator  # noqa: E402
from allocator.rules.versions import accelerate_at_least  # noqa: E402
from allocator.evaluate.validate import check  # noqa: E402
from models import DTYPE, SEED, SavedModel, StreamMeter, tiny_specs  # noqa: E402

LLAMA_REST = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu"}
GPT2_BODY = {"transformer.wpe": "cpu", "transformer.h": "cpu", "transformer.ln_f": "cpu"}
CPU = torch.device("cpu")
# accelerate 1.16 reads a one-device "disk" map on the CPU and loads persistent buffers mapped to disk to the CPU
READS_DISK = accelerate_at_least((1, 16))
RESNET_REST = {"resnet.embedder": "cpu", "resnet.encoder.stages.0": "cpu", "resnet.pooler": "cpu", "classifier": "cpu"}

# (row, model, device map, offload_buffers, {loader: loads and computes right}, violation kinds where it does not)
ROWS = [
    ("nested-keys", "llama", {"": "cpu", "lm_head": "disk"}, False,
     {"transformers": False, "accelerate": False}, {"nested"}),
    ("nested-keys-inner", "llama", {"model": "cpu", "model.layers.1": "disk", "lm_head": "cpu"}, False,
     {"transformers": False, "accelerate": False}, {"nested"}),
    ("disk-only", "llama", {"model": "disk", "lm_head": "disk"}, False,
     {"transformers": True, "accelerate": READS_DISK}, {"disk-only"}),
    ("tie-on-disk", "gpt2", {"transformer.wte": "disk", **GPT2_BODY, "lm_head": "disk"}, False,
     {"transformers": True, "accelerate": False}, {"tied"}),
    ("tie-split-cpu-disk", "gpt2", {"transformer": "cpu", "lm_head": "disk"}, False,
     {"transformers": False, "accelerate": True}, {"tied"}),
    ("tie-split-cpu-disk-and-more-disk", "gpt2", {"transformer.wte": "cpu", "transformer.wpe": "cpu",
                                                 "transformer.h": "disk", "transformer.ln_f": "cpu",
                                                 "lm_head": "disk"}, False,
     {"transformers": False, "accelerate": False}, {"tied"}),
    ("tie-split-disk-cpu", "gpt2", {"transformer.wte": "disk", **GPT2_BODY, "lm_head": "cpu"}, False,
     {"transformers": False, "accelerate": False}, {"tied"}),
    ("persistent-buffer-alone-on-disk", "bart", {"model": "cpu", "lm_head": "cpu", "final_logits_bias": "disk"},
     False, {"transformers": True, "accelerate": READS_DISK}, {"unread-buffer"}),
    ("persistent-buffer-alone-on-disk-offload-buffers", "bart",
     {"model": "cpu", "lm_head": "cpu", "final_logits_bias": "disk"}, True,
     {"transformers": False, "accelerate": False}, {"unhooked"}),
    ("non-persistent-buffer-alone-on-disk", "llama",
     {**LLAMA_REST, "model.rotary_emb.inv_freq": "disk", "lm_head": "disk"}, False,
     {"transformers": True, "accelerate": True}, set()),
    ("non-persistent-buffer-left-out", "llama", {**LLAMA_REST, "lm_head": "disk"}, False,
     {"transformers": True, "accelerate": True}, set()),
    ("buffers-of-a-disk-module", "resnet", {**RESNET_REST, "resnet.encoder.stages.1": "disk"}, False,
     {"transformers": True, "accelerate": READS_DISK}, {"unread-buffer"}),
    ("buffers-of-a-disk-module-offload-buffers", "resnet", {**RESNET_REST, "resnet.encoder.stages.1": "disk"}, True,
     {"transformers": True, "accelerate": True}, set()),
    ("unknown-key", "llama", {"model": "cpu", "lm_head": "disk", "nothing.here": "cpu"}, False,
     {"transformers": True, "accelerate": True}, set()),
    # torch.device values: "cpu" beside torch.device("cpu") makes the latter main (hooks on the "cpu" modules)
    ("cpu-string-and-device", "llama", {"model": "cpu", "lm_head": CPU}, False,
     {"transformers": True, "accelerate": False}, {"device-object"}),
    ("cpu-device-and-disk", "llama", {"model": CPU, "lm_head": "disk"}, False,
     {"transformers": False, "accelerate": False}, {"device-object"}),
    ("cpu-device-only", "llama", {"model": CPU, "lm_head": CPU}, False,
     {"transformers": True, "accelerate": False}, {"device-object"}),
]
LOADERS = ("transformers", "accelerate")


def specs() -> dict:
    from transformers import BartConfig, BartForConditionalGeneration, ResNetConfig, ResNetForImageClassification

    found = tiny_specs()
    tokens, pixels = found["llama"][2], found["vit"][2]
    found["bart"] = (BartForConditionalGeneration, BartConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=1000, max_position_embeddings=64), tokens)
    found["resnet"] = (ResNetForImageClassification, ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3), pixels)
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory, quiet):
    root = tmp_path_factory.mktemp("loader_models")
    found = specs()
    return {name: SavedModel(name, *found[name], root, perturb_buffers=True)
            for name in sorted({row[1] for row in ROWS})}


def load(case, loader: str, device_map: dict, offload_buffers: bool, folder):
    """The model loaded on ``loader``'s path with ``device_map`` (the whole map, as the caller gives it)."""
    if loader == "transformers":
        return case.cls.from_pretrained(case.path, dtype=DTYPE, device_map=dict(device_map),
                                        offload_folder=str(folder), offload_buffers=offload_buffers)
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = case.cls(case.config)
    model.tie_weights()   # as accelerate asks before loading ("The model weights are not tied")
    return load_checkpoint_and_dispatch(model, case.path, device_map=dict(device_map), offload_folder=str(folder),
                                        offload_buffers=offload_buffers, dtype=DTYPE)


def works(case, loader, device_map, offload_buffers, folder, meter) -> bool:
    """Whether the load and a forward succeed and give the in-RAM model's outputs (``meter`` measures the forward's
    streamed peak)."""
    torch.manual_seed(SEED)
    try:
        model = load(case, loader, device_map, offload_buffers, folder)
        meter.name_modules(model)
        meter.reset()
        logits = case.logits(model)
    except (KeyError, ValueError, RuntimeError, SafetensorError) as err:
        logging.getLogger(__name__).info("%s: %s: %s", loader, type(err).__name__, err)
        return False
    return bool(torch.allclose(logits, case.reference, rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_valid_exactly_when_the_load_works(saved, row, loader, tmp_path, caplog, monkeypatch):
    label, name, device_map, offload_buffers, measured, kinds = row
    case = saved[name]
    with caplog.at_level(logging.WARNING, logger="allocator"):
        problem = allocator.build_problem(case.meta, {"cpu": 4 * case.total}, loader=loader,
                                          offload_buffers=offload_buffers)
        violations, memory = check(problem, device_map)
    meter = StreamMeter(monkeypatch)
    ok = works(case, loader, device_map, offload_buffers, tmp_path / "offload", meter)
    assert ok == measured[loader], f"{label} on {loader}: the load {'works' if ok else 'fails'} now"
    assert (not violations) == ok, f"{label} on {loader}: {violations}"
    assert {v.kind for v in violations} == (set() if ok else kinds), violations
    # the offloaded weights the hooks held at once (measured) fit the predicted streaming reserve; with "cpu" beside
    # torch.device("cpu") the hooks of the "cpu" modules hand their RAM tensors to the same device, which Tensor.to
    # returns as they are: the meter sees them materialised, but no byte is added to what RAM already holds
    if ok and label != "cpu-string-and-device":
        assert meter.max <= memory.streamed, (label, loader, meter.max, memory.streamed, meter.at_max)
        assert meter.max > 0 or memory.streamed == 0 or "disk" not in device_map.values(), (label, loader)
    if label == "unknown-key":   # ignored by both loaders: a warning, not a violation
        assert "nothing.here" in caplog.text


def test_every_violation_says_the_fix(saved):
    for label, name, device_map, offload_buffers, measured, _ in ROWS:
        for loader in LOADERS:
            for v in allocator.validate(saved[name].meta, device_map, {"cpu": 4 * saved[name].total}, loader=loader,
                                        offload_buffers=offload_buffers):
                assert any(word in v.message for word in ("map ", "pass ", "keep ")), (label, loader, v)


class _Block(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(n, n), torch.nn.BatchNorm1d(n)   # persistent running stats

    def forward(self, x):
        return self.norm(self.linear(x))


class _Net(torch.nn.Module):
    """Linears and no-split blocks with BatchNorm statistics, in turn."""

    _no_split_modules = ["_Block"]

    def __init__(self, n=256):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(n, n) if i % 2 == 0 else _Block(n) for i in range(8)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("strategy", ["backfill", "reserve", "auto"])
def test_first_fit_steers_buffers_off_disk_on_accelerates_path(strategy, monkeypatch):
    """On accelerate 1.15's path (offload_buffers=False) the blocks' BatchNorm statistics would never be read from disk:
    the first fit keeps those blocks in RAM and sends the Linears to disk, where filtering its model-order fills found
    no plan at this budget. The rules are those of accelerate 1.15 whatever is installed (1.16 reads such buffers)."""
    monkeypatch.setattr(allocator.rules.versions, "ACCELERATE", (1, 15, 0))
    with torch.device("meta"):
        model = _Net()
    total = allocator.build_problem(model, {"cpu": 10**9}).graph.total
    plan = allocator.plan(model, {"cpu": int(0.7 * total)}, strategy=strategy, loader="accelerate", strict=True)
    assert not allocator.validate(model, plan.device_map, {"cpu": int(0.7 * total)}, loader="accelerate")
    blocks = [f"layers.{i}" for i in range(1, 8, 2)]
    assert all(plan.device_map[name] == "cpu" for name in blocks), plan.device_map
    assert "disk" in plan.device_map.values()
