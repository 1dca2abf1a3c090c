"""A device-map value means, under ``allocator.patch()``, what transformers means by it on ``from_pretrained``.

transformers 5's ``_get_device_map`` balances every value but ``"sequential"`` (accelerate's ``get_balanced_memory``
before ``infer_auto_device_map``). Under the patch, ``"auto"`` over several GPUs is our balanced split: it uses every
GPU transformers' map uses and leaves at least as much free memory on the fullest GPU; ``"sequential"`` is
transformers' own sequential map. The maps of two-GPU budgets are captured inside ``from_pretrained`` at
``_get_device_map`` (the load stops there; tests/conftest.py counts the GPUs as present). An accelerator absent at load
time is left out of the plan with one warning, and the load that works unpatched works patched, with the same outputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformers.modeling_utils as modeling_utils  # noqa: E402

import allocator  # noqa: E402
from allocator.judge.verdict import headroom  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-5}   # float32 logits of two loads (RAM/disk offload against RAM)


def configs() -> dict:
    t = transformers
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2000)
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**small, tie_word_embeddings=False)),
        # a VLM with a vision tower and a text model: the towers are separate no-split blocks
        "qwen2-vl": (t.Qwen2VLForConditionalGeneration, t.Qwen2VLConfig(
            text_config=dict(**small), vision_config=dict(depth=4, embed_dim=64, hidden_size=64, num_heads=4,
                                                          mlp_ratio=2, in_channels=3, patch_size=14))),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    out = {}
    for name, (cls, config) in configs().items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        cls(config).save_pretrained(folder)
        with torch.device("meta"):
            meta = cls(config)
        out[name] = cls, str(folder), meta
    return out


class _Captured(Exception):
    pass


def captured_map(cls, folder: str, mode: str, max_memory: dict, *, patched: bool) -> dict:
    """The map ``from_pretrained(device_map=mode)`` computes, taken at ``_get_device_map`` (the load stops there)."""
    seen = {}

    def run():
        current = modeling_utils._get_device_map

        def spy(*args, **kwargs):
            seen["map"] = dict(current(*args, **kwargs))
            raise _Captured

        modeling_utils._get_device_map = spy
        try:
            cls.from_pretrained(folder, device_map=mode, max_memory=dict(max_memory))
        except _Captured:
            pass
        finally:
            modeling_utils._get_device_map = current

    if patched:
        with allocator.patch():
            run()
    else:
        run()
    return seen["map"]


def gpus(device_map: dict) -> set:
    return {d for d in device_map.values() if d not in ("cpu", "disk")}


@pytest.mark.parametrize("name", list(configs()))
@pytest.mark.parametrize("share", [0.7, 1.3])
def test_auto_over_two_gpus_balances_as_transformers_does(saved, name, share):
    cls, folder, meta = saved[name]
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    budgets = {0: int(total * share), 1: int(total * share), "cpu": 4 * total}
    theirs = captured_map(cls, folder, "auto", budgets, patched=False)
    ours = captured_map(cls, folder, "auto", budgets, patched=True)
    where = f"{name} at {share} of the model per GPU: ours {ours}, theirs {theirs}"
    assert gpus(theirs) == {0, 1}, where   # transformers splits, even where one GPU holds the model (share 1.3)
    assert gpus(ours) >= gpus(theirs), where
    problem = allocator.build_problem(meta, budgets)
    assert headroom(problem, ours) >= headroom(problem, theirs), where
    assert not allocator.validate(meta, ours, budgets), where


def test_headroom_is_part_of_rule_3_on_from_pretrained(saved):
    """Rule 3 with transformers' map as the baseline (``PlanOptions.baseline``, set by the patch): a map that packs
    GPU 0 where transformers splits breaks the floor; without a baseline (``plan()``, accelerate's path) it does not."""
    cls, folder, meta = saved["llama"]
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    budgets = {0: int(total * 1.3), 1: int(total * 1.3), "cpu": 4 * total}
    theirs = captured_map(cls, folder, "auto", budgets, patched=False)
    packed = {"": 0}
    on_their_path = allocator.build_problem(meta, budgets, baseline=theirs)
    assert [v.kind for v in allocator.contract_violations(on_their_path, packed)] == ["contract-floor"]
    assert "free on its fullest accelerator" in allocator.contract_violations(on_their_path, packed)[0].message
    assert allocator.contract_violations(allocator.build_problem(meta, budgets), packed) == []


@pytest.mark.parametrize("name", list(configs()))
def test_sequential_is_transformers_sequential_map(saved, name):
    cls, folder, meta = saved[name]
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    budgets = {0: int(total * 0.6), 1: int(total * 0.6), "cpu": 4 * total}
    theirs = captured_map(cls, folder, "sequential", budgets, patched=False)
    ours = captured_map(cls, folder, "sequential", budgets, patched=True)
    assert ours == theirs   # accelerate's greedy fill, reservations included (tiny models: GPU 0 may stay empty)
    assert list(ours.values()) == sorted(ours.values(), key=[0, 1, "cpu", "disk"].index)


def test_plan_and_infer_auto_device_map_stay_sequential(saved):
    """Off ``from_pretrained`` nothing balances: ``plan()`` packs GPU 0 first where it holds the model."""
    _, _, meta = saved["llama"]
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    budgets = {0: int(total * 1.3), 1: int(total * 1.3), "cpu": 4 * total}
    assert set(allocator.plan(meta, budgets).device_map.values()) == {0}
    assert set(allocator.infer_auto_device_map(meta, budgets).values()) == {0}


@pytest.mark.slow
def test_qwen25_omni_7b_thinker_on_two_22gib_gpus():
    """The issue's case, planned on the meta device: the 16.6 GiB bf16 thinker on {0: 22GiB, 1: 22GiB}. Unpatched
    transformers splits 15/19 top-level modules; patched, the map used to be {"": 0} (GPU 1 empty)."""
    t = transformers
    config = t.Qwen2_5OmniThinkerConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
        audio_config=dict(d_model=1280, encoder_layers=32, encoder_ffn_dim=5120, encoder_attention_heads=20,
                          output_dim=3584))
    with torch.device("meta"):
        model = t.Qwen2_5OmniThinkerForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    budgets = {0: "22GiB", 1: "22GiB", "cpu": "100GiB"}
    theirs = modeling_utils._get_device_map(model, "auto", dict(budgets), None)
    with allocator.patch():
        ours = modeling_utils._get_device_map(model, "auto", dict(budgets), None)
    problem = allocator.build_problem(model, budgets)
    assert gpus(theirs) == gpus(ours) == {0, 1}, ours
    assert headroom(problem, ours) >= headroom(problem, theirs)


# -- accelerators absent at load time -----------------------------------------------------------------------------

def _absent_index() -> int:
    """The first accelerator index this machine lacks."""
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "device_count"):
        return torch.accelerator.device_count()
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.slow
@pytest.mark.load_time_devices
def test_an_absent_gpu_is_left_out_with_one_warning(tmp_path):
    """The issue's case scaled down 16×: a 16 MiB llama with {absent GPU: 6400KiB, "cpu": 8960KiB}. transformers'
    map leaves the GPU empty and loads on CPU and disk; under the patch the plan used the GPU and the load died in
    ``caching_allocator_warmup`` ("Cannot access accelerator device when none is available")."""
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, vocab_size=8000, num_hidden_layers=12,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "model")
    gpu = _absent_index()
    budgets = {gpu: "6400KiB", "cpu": "8960KiB"}
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory=dict(budgets), offload_folder=str(tmp_path / "u")).eval()
    assert gpu not in theirs.hf_device_map.values()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with allocator.patch():
            ours = transformers.LlamaForCausalLM.from_pretrained(
                tmp_path / "model", device_map="auto", max_memory=budgets, offload_folder=str(tmp_path / "o")).eval()
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "at load time" in str(w.message)]
    assert len(said) == 1 and f"[{gpu}]" in said[0], said
    assert [w.filename for w in caught if "at load time" in str(w.message)] == [__file__]   # the user's line
    assert budgets == {gpu: "6400KiB", "cpu": "8960KiB"}   # the caller's dict is untouched
    assert set(ours.hf_device_map.values()) <= {"cpu", "disk"}
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, **TOL)
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, **TOL)


@pytest.mark.parametrize("share", [0.45, 0.7])
def test_auto_over_two_gpus_is_balanced_where_it_fits_else_the_contracts_plan(saved, share):
    """``"auto"`` on ``from_pretrained`` over two GPUs: where the balanced split keeps the model on the GPUs (0.7 of
    it per GPU) the patched map is ``balanced``'s, not the contract's packing; where it does not (0.45 per GPU:
    balanced leaves part in RAM) the patched map is the contract's plan (``auto``), which here differs from
    balanced's. Both plans are made over the same budgets with transformers' map as the baseline."""
    cls, folder, meta = saved["llama"]
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    budgets = {0: int(total * share), 1: int(total * share), "cpu": 4 * total}
    theirs = captured_map(cls, folder, "auto", budgets, patched=False)
    ours = captured_map(cls, folder, "auto", budgets, patched=True)
    plans = {s: allocator.plan(meta, budgets, strategy=s, loader="transformers", baseline=theirs).device_map
             for s in ("balanced", "auto")}
    assert plans["balanced"] != plans["auto"], plans
    fits = set(plans["balanced"].values()) <= {0, 1}
    assert fits == (share == 0.7), plans["balanced"]
    assert ours == plans["balanced" if fits else "auto"], (ours, plans)
