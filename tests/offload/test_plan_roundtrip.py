"""The plan as data carries every decision the runtime runs (issue #46): for a plan of each runtime, ``attach(model,
Plan.from_dict(json.loads(json.dumps(plan.to_dict()))))`` ends in the same runtime state as ``attach(model, plan)``.

:func:`runtime_state` reads everything an attached runtime holds (the hooks on every module, by kind, with their
phases and threshold; the offloaded units; prefetch; the experts run expert by expert with their resident experts,
mode, home device and fetch chunk; the expert cache; the hooks taken off; the plan's runtime it holds), so a field the
schema drops on the way shows as a difference: :func:`test_a_dropped_field_shows` drops each one in turn.

Plans for an accelerator main device are loaded here with their accelerators' modules in RAM and the offloaded ones
on disk, and run on :class:`allocator.offload.StandInDevice`, as ``tests/offload/test_hybrid_runtime.py`` does.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import allocator
from allocator import offload
from allocator.offload import ExpertsHook, HybridHook, OffloadHook
from allocator.offload.hybrid import LayerHook
from allocator.report.runtime import Runtime

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from accelerate.hooks import SequentialHook  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moe_models import small_config  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128)


def runtime_state(model, runtime) -> dict:
    """Everything the runtime attached to ``model`` holds and runs, as comparable data."""
    hooks = {}
    for name, module in model.named_modules():
        top = module.__dict__.get("_hf_hook")
        if top is not None:
            hooks[name] = tuple(_hook(h) for h in (top.hooks if isinstance(top, SequentialHook) else (top,)))
    return {
        "hooks": hooks,
        "units": [u.name for u in runtime.units],
        "prefetch": runtime.prefetch,
        "prefetch_thread": runtime.executor is not None,
        "device": type(runtime.device).__name__,
        "experts": {r.layer.experts: {"where": tuple(r.where), "resident": tuple(sorted(r.rows)), "mode": r.mode,
                                      "home": r.home, "main": r.main, "chunk": r.chunk, "threshold": r.threshold,
                                      "remote": dict(r.remote), "cached": r.cache is not None}
                    for r in runtime.experts.values()},
        "expert_cache": None if runtime.cache is None else runtime.cache.slots,
        "experts_implementation": getattr(getattr(model, "config", None), "_experts_implementation", None),
        "passthrough": sorted(name for name, m in model.named_modules()
                              if any(t.module is m for t in runtime.passthrough)),
        "plan": runtime.plan,
    }


def _hook(h):
    if isinstance(h, LayerHook):
        return "layer", h.layer, tuple(sorted(h.phases.items())), h.threshold
    if isinstance(h, HybridHook):
        return "hybrid", h.unit.name, tuple(sorted(h.phases.items())), h.threshold
    if isinstance(h, OffloadHook):
        return "offload", h.unit.name
    if isinstance(h, ExpertsHook):
        return "experts", h.routed.layer.experts, str(h.execution_device)
    return (type(h).__name__,)


#: What the runtime does differently, not only holds, when a field is lost: the state less the plan it holds.
def behaviour(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "plan"}


def _on_this_machine(device_map: dict) -> dict:
    """A map with accelerators as loaded here: their modules in RAM, the offloaded ones on disk."""
    return {k: "disk" if v in ("cpu", "disk") else "cpu" for k, v in device_map.items()}


def _meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _total(meta) -> int:
    return allocator.build_problem(meta, {"cpu": 0}).graph.total


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name -> (the model loaded with the plan's map, the plan, attach's keywords)."""
    root = tmp_path_factory.mktemp("roundtrip")
    llama = transformers.LlamaConfig(**TINY)
    moe = small_config("qwen3_moe", layers=6)
    out = {}
    for family, config in (("llama", llama), ("moe", moe)):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / family)
    meta = _meta(llama)
    total = _total(meta)
    for name, plan, device in (
        ("accelerate", allocator.plan(meta, {"cpu": int(total * 0.6)}), None),
        ("allocator-cpu", allocator.plan(meta, {"cpu": int(total * 0.6)}, runtime="allocator"), None),
        ("allocator-accelerator", allocator.plan(meta, {0: int(total * 0.45), "cpu": 4 * total}, runtime="allocator",
                                                 generation=allocator.GenerationBudget(1, 32, prompt_length=12)),
         "stand-in"),
    ):
        out[name] = (plan, "llama", device)
    meta = _meta(moe)
    total = _total(meta)
    plan = allocator.plan(meta, {0: int(total * 0.6), 1: int(total * 0.2), "cpu": 4 * total}, runtime="allocator",
                          expert_cache=2)
    # plan() decides "auto" for every layer; other modes here, so that a mode lost on the way shows
    modes = {k: ("fetch", "compute", "auto")[i % 3] for i, k in enumerate(plan.runtime.experts)}
    plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, expert_mode=modes))
    out["moe"] = (plan, "moe", "stand-in")
    loaded = {}
    for name, (plan, family, device) in out.items():
        if device == "stand-in":
            plan = dataclasses.replace(plan, device_map=_on_this_machine(plan.device_map))
        model = AutoModelForCausalLM.from_pretrained(root / family, device_map=plan.device_map,
                                                     offload_folder=root / f"{name}-offload",
                                                     experts_implementation="eager" if family == "moe" else None)
        loaded[name] = (model.eval(), plan, {"device": device})
    return loaded


def _state(model, plan, keywords) -> dict:
    runtime = offload.attach(model, plan, **keywords)
    try:
        return runtime_state(model, runtime)
    finally:
        offload.detach(model)


def _saved(plan) -> dict:
    return json.loads(json.dumps(plan.to_dict()))


def test_the_cases_hold_what_they_test(cases):
    """Each case has what its runtime decides: else the round trip below could not see it lost."""
    (_, accelerate, _), (_, cpu, _) = cases["accelerate"], cases["allocator-cpu"]
    assert accelerate.runtime.name == "accelerate" and cpu.runtime.streams and cpu.main_device == "cpu"
    _, hybrid, _ = cases["allocator-accelerator"]
    assert hybrid.main_device == 0 and any("cpu" in phases.values() for phases in hybrid.compute.values())
    _, moe, _ = cases["moe"]
    r = moe.runtime
    assert moe.main_device == 0 and r.expert_cache > 0 and r.fetch_chunk and any(r.resident.values())
    assert set(r.runs_on.values()) == {0, 1}   # its compute map may be empty: experts modules run expert by expert


@pytest.mark.parametrize("case", ["accelerate", "allocator-cpu", "allocator-accelerator", "moe"])
def test_a_saved_plan_attaches_the_same_runtime(cases, case):
    model, plan, keywords = cases[case]
    direct = _state(model, plan, keywords)
    saved = _state(model, allocator.Plan.from_dict(_saved(plan)), keywords)
    assert saved == direct
    if case == "allocator-accelerator":
        assert sum(kind == "hybrid" for hooks in direct["hooks"].values() for kind, *_ in hooks) > 0
    if case == "moe":
        assert direct["experts"] and direct["expert_cache"] and any(e["chunk"] for e in direct["experts"].values())


@pytest.mark.parametrize("case", ["accelerate", "allocator-cpu"])
def test_a_plan_revalidated_against_the_model_attaches_the_same_runtime(cases, case):
    model, plan, keywords = cases[case]
    meta = _meta(model.config)
    again = allocator.Plan.from_dict(_saved(plan), meta)
    assert _state(model, again, keywords) == _state(model, plan, keywords)


DROPPED = ["compute", *(f"runtime.{f.name}" for f in dataclasses.fields(Runtime))]
#: Fields the runtime only holds (``runtime_of(model).plan``): losing them changes no hook.
HELD = {"runtime.name", "runtime.buffers"}


@pytest.mark.parametrize("field", DROPPED)
def test_a_dropped_field_shows(cases, field):
    """The comparison fails where the data loses ``field``: in some case the runtime attached from the saved plan
    differs (in what it runs, except for the fields it only holds)."""
    differs = []
    for model, plan, keywords in cases.values():
        if field == "runtime.threshold":   # batch 1 decodes 1 token, the default: a threshold of 4 must survive too
            plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, threshold=4))
        data = _saved(plan)
        section, _, key = field.rpartition(".")
        where = data[section] if section else data
        if where is None or key not in where:
            continue
        del where[key]
        direct = _state(model, plan, keywords)
        saved = _state(model, allocator.Plan.from_dict(data), keywords)
        differs.append(saved != direct if field in HELD else behaviour(saved) != behaviour(direct))
    assert any(differs), field


def test_a_compute_map_without_its_threshold_is_refused(cases):
    _, plan, _ = cases["allocator-accelerator"]
    data = _saved(plan)
    del data["hybrid"]
    with pytest.raises(allocator.InvalidOption, match="no 'hybrid' section"):
        allocator.Plan.from_dict(data)


def test_a_version_2_plan_attaches_its_compute_map(cases):
    """A ``/2`` plan carries no ``hybrid``: its threshold is made from its saved options, as the planner made it."""
    model, plan, keywords = cases["allocator-accelerator"]
    data = _saved(plan)
    data["schema"] = "allocator.plan/2"
    del data["hybrid"]
    assert _state(model, allocator.Plan.from_dict(data), keywords) == _state(model, plan, keywords)
