"""LoRA adapters on an offloaded base under ``allocator.patch()``, both runtimes (issue 48).

PEFT's ``PeftModel.from_pretrained(base, adapter, max_memory=..., offload_folder=...)`` re-plans a dispatched base
through accelerate's ``get_balanced_memory`` and ``infer_auto_device_map`` imported by name into ``peft.peft_model``,
rebuilds the disk-offload index from the base's hooks (``original_devices``, ``weights_map``), takes the hooks off and
dispatches the wrapped model again. A tiny llama is saved, a LoRA adapter with random non-zero weights is made with
``get_peft_model`` and saved, and the base is loaded under the patch with half its bytes in RAM (the rest on disk):
the adapter loaded on it must compute what the LoRA model in RAM computes (greedy tokens exactly, logits within
``atol=rtol=1e-4``), and PEFT's map must keep in RAM what the patched base plan kept there (accelerate's own planner,
which PEFT calls unpatched, sends ``lm_head`` back to disk). Also: a fake library importing accelerate's functions
by name is patched and restored, and the runtime ends when accelerate's ``remove_hook_from_submodules`` takes its
hooks off; a model the runtime runs saves (``save_pretrained`` reads disk tensors through ``weights_map``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import accelerate.utils.modeling as accelerate_modeling  # noqa: E402
import peft.peft_model as peft_model  # noqa: E402
from accelerate.big_modeling import dispatch_model  # noqa: E402
from accelerate.hooks import remove_hook_from_submodules  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import allocator.integrations.transformers as hf  # noqa: E402
from allocator.integrations.library import baseline_map  # noqa: E402
from allocator.offload import runtime_of  # noqa: E402
from allocator.offload.handover import CARRIED  # noqa: E402
from models import DTYPE, SavedModel, tiny_specs  # noqa: E402

TOL = {"atol": 1e-4, "rtol": 1e-4}
PREFIX = "base_model.model."
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def lora(tmp_path_factory, quiet):
    """The saved tiny llama (half its bytes as the RAM budget), a saved LoRA adapter with random non-zero weights,
    and what the LoRA model computes fully in RAM: logits and greedy tokens."""
    root = tmp_path_factory.mktemp("peft_models")
    case = SavedModel("llama", *tiny_specs()["llama"], root)
    base = case.cls.from_pretrained(case.path, dtype=DTYPE)
    torch.manual_seed(1)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(root / "adapter"))
    reference = PeftModel.from_pretrained(case.cls.from_pretrained(case.path, dtype=DTYPE), str(root / "adapter"))
    case.adapter = str(root / "adapter")
    case.lora_logits = case.logits(reference)
    case.lora_tokens = _greedy(reference, case)
    assert (case.lora_logits - case.reference).abs().max() > 1e-2   # the adapter changes what the model computes
    return case


def _greedy(model, case):
    with torch.no_grad():
        return model.generate(input_ids=case.inputs["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False)


def _device_of(name: str, device_map: dict):
    """The device ``device_map`` gives tensor ``name`` (its longest key prefix)."""
    keys = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
    return device_map[max(keys, key=len)]


def _ram_bytes(model, device_map, prefix: str = "") -> dict:
    """Base tensor name (PEFT's ``base_model.model.`` and ``.base_layer`` taken off) -> bytes, for the base model's
    tensors ``device_map`` keeps in RAM; LoRA's own tensors are left out."""
    kept = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if "lora_" in name or _device_of(name, device_map) != "cpu":
            continue
        base = name.removeprefix(prefix).replace(".base_layer.", ".")
        kept[base] = tensor.numel() * tensor.element_size()
    return kept


@pytest.mark.parametrize("runtime", ["accelerate", "allocator"])
def test_adapter_on_an_offloaded_base_computes_the_lora_model_and_keeps_the_plan(lora, runtime, tmp_path):
    with hf.patch(runtime=runtime):
        base = lora.load("auto", tmp_path / "base")
        base_map = dict(base.hf_device_map)
        assert set(base_map.values()) == {"cpu", "disk"} and base_map["lm_head"] == "cpu", base_map
        base_ram = _ram_bytes(base, base_map)
        before = runtime_of(base)
        model = PeftModel.from_pretrained(base, lora.adapter, max_memory=dict(lora.max_memory),
                                          offload_folder=str(tmp_path / "peft"))
        peft_map = dict(model.hf_device_map)
        torch.testing.assert_close(lora.logits(model), lora.lora_logits, **TOL)
        assert torch.equal(_greedy(model, lora), lora.lora_tokens)
        after = runtime_of(model)
    assert "disk" in peft_map.values() and peft_map[PREFIX + "lm_head"] == "cpu", peft_map
    peft_ram = _ram_bytes(model, peft_map, PREFIX)
    assert sum(peft_ram.values()) >= sum(base_ram.values()) and set(base_ram) <= set(peft_ram), (peft_map, base_map)
    if runtime == "allocator":   # the base's runtime ended with its hooks; the wrapped model runs a new one
        assert before is not None and after is not None and after is not before and after.fetches > 0
        assert before.executor is None or before.executor._shutdown
        assert "_allocator_runtime" not in vars(base)
    else:
        assert before is None and after is None


def test_a_library_importing_accelerates_planners_by_name_is_patched_and_restored():
    fake = types.ModuleType("fake_adapter_library")
    fake.infer_auto_device_map = accelerate_modeling.infer_auto_device_map
    fake.get_balanced_memory = accelerate_modeling.get_balanced_memory
    fake.dispatch_model = dispatch_model
    fake.unrelated = len
    originals = {name: getattr(fake, name) for name in ("infer_auto_device_map", "get_balanced_memory",
                                                        "dispatch_model")}
    sys.modules[fake.__name__] = fake
    try:
        with hf.patch(runtime="allocator") as handle:
            for name, original in originals.items():
                assert f"fake_adapter_library.{name}" in handle.patched
                assert getattr(fake, name).__allocator_original__ is original
            assert peft_model.infer_auto_device_map is not accelerate_modeling.infer_auto_device_map
            with hf.patch() as inner:   # nested: the inner patch replaces the outer's replacement, then restores it
                assert "fake_adapter_library.infer_auto_device_map" in inner.patched
                assert fake.infer_auto_device_map.__allocator_original__.__allocator_original__ is \
                    accelerate_modeling.infer_auto_device_map
            assert fake.infer_auto_device_map.__allocator_original__ is accelerate_modeling.infer_auto_device_map
    finally:
        del sys.modules[fake.__name__]
    assert fake.infer_auto_device_map is accelerate_modeling.infer_auto_device_map
    assert fake.get_balanced_memory is accelerate_modeling.get_balanced_memory
    assert fake.dispatch_model is dispatch_model and fake.unrelated is len
    assert peft_model.infer_auto_device_map is accelerate_modeling.infer_auto_device_map
    assert peft_model.get_balanced_memory is accelerate_modeling.get_balanced_memory


def test_accelerates_own_namespaces_are_not_searched():
    with hf.patch():
        assert accelerate.infer_auto_device_map is accelerate_modeling.infer_auto_device_map
        assert accelerate.utils.get_balanced_memory is accelerate_modeling.get_balanced_memory


def test_runtime_hooks_carry_what_peft_reads_and_the_runtime_ends_when_they_come_off(lora, tmp_path):
    with hf.patch(runtime="allocator"):
        model = lora.load("auto", tmp_path / "base")
    runtime = runtime_of(model)
    offloaded = [m for _, m in model.named_modules() if type(getattr(m, "_hf_hook", None)).__name__ == "OffloadHook"]
    assert offloaded and len(offloaded) == len(runtime.units)
    for unit in runtime.units:
        for field in CARRIED:
            assert getattr(unit.module._hf_hook, field) is getattr(unit.original, field)
        assert torch.device("meta") in unit.module._hf_hook.original_devices.values()
        assert hasattr(unit.module._hf_hook.weights_map, "dataset")   # PEFT's disk index is rebuilt from here
    torch.testing.assert_close(lora.logits(model), lora.reference, **TOL)
    model.save_pretrained(str(tmp_path / "resaved"))   # transformers reads disk tensors through weights_map
    resaved = lora.cls.from_pretrained(str(tmp_path / "resaved"), dtype=DTYPE)
    torch.testing.assert_close(lora.logits(resaved), lora.reference, **TOL)
    remove_hook_from_submodules(model)
    assert "_allocator_runtime" not in vars(model) and runtime_of(model) is None   # ended with its last hook
    assert runtime.executor is None or runtime.executor._shutdown
    assert not any(hasattr(m, "_hf_hook") for _, m in model.named_modules())


def test_a_librarys_own_planner_run_for_the_baseline_gets_accelerates_functions(lora):
    """diffusers' own ``_determine_device_map`` (the baseline of rule 3) calls accelerate's functions from a namespace
    the patch rebinds: while :func:`baseline_map` runs it, they are accelerate's."""
    budgets = dict(lora.max_memory)
    theirs = accelerate_modeling.infer_auto_device_map(lora.meta, max_memory=dict(budgets))
    with hf.patch():
        ours = peft_model.infer_auto_device_map(lora.meta, max_memory=dict(budgets))
        baseline = baseline_map(lambda: peft_model.infer_auto_device_map(lora.meta, max_memory=dict(budgets)),
                                lora.meta, "a library's own planner")
    assert baseline == theirs and ours != theirs, (ours, theirs)


def test_a_library_imported_after_the_patch_began_is_patched_and_restored(tmp_path, monkeypatch):
    (tmp_path / "late_adapter_library.py").write_text(
        "from accelerate import infer_auto_device_map\nfrom accelerate.utils import get_balanced_memory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    original = accelerate_modeling.infer_auto_device_map
    try:
        with hf.patch() as handle:
            import late_adapter_library as late

            assert "late_adapter_library.infer_auto_device_map" in handle.patched
            assert "late_adapter_library.get_balanced_memory" in handle.patched
            assert late.infer_auto_device_map.__allocator_original__ is original
            assert type(late.__loader__).__name__ == "SourceFileLoader" and late.__spec__.loader is late.__loader__
        assert late.infer_auto_device_map is original
        assert late.get_balanced_memory is accelerate_modeling.get_balanced_memory
        assert not any(type(f).__name__ == "AfterImport" for f in sys.meta_path)
    finally:
        sys.modules.pop("late_adapter_library", None)
