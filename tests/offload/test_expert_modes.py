"""Issue #46: the runtime runs the plan's expert decisions as written. The plan decides, per offloaded experts layer and
phase, whether the routed experts are fetched to the main device or computed where they live
(``Plan.runtime.expert_mode``); on the stand-in accelerator each layer runs each phase in that mode (the runtime counts
the calls per phase and mode), the tokens equal the model in RAM, and what the runtime holds at once stays within the
plan's reserve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import allocator
from allocator import offload

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from moe_models import small_model  # noqa: E402

#: Slow copies and a slow CPU, no cost per change of device: fetching wins at prefill (many tokens per expert, CPU
#: compute dominates) and computing where the experts live wins at decode (one token: the copy dominates).
PROFILE = allocator.Profile(host_to_device=1e8, pinned_host_to_device=1e8, cpu_flops=1e8, switch_latency=0.0)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    small_model("qwen3_moe", layers=4, num_experts=16).save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    plan = allocator.plan(meta, {0: int(total * 0.5), "cpu": 4 * total}, runtime="allocator", prefetch=0,
                          generation=allocator.GenerationBudget(1, 24), profile=PROFILE)
    return folder, ref, plan


def _attached(folder, plan, tmp_path, **options):
    """The model loaded with the plan's map on the stand-in (the accelerator's modules in RAM, offloaded ones read
    from files) and the runtime attached with the plan."""
    loaded = {k: ("disk" if v in ("cpu", "disk") else "cpu") for k, v in plan.device_map.items()}
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=loaded, offload_folder=tmp_path / "off",
                                                 experts_implementation="eager").eval()
    runtime = offload.attach(model, dataclasses.replace(plan, device_map=loaded), device="stand-in", prefetch=0,
                             **options)
    return model, runtime


def _generate(model):
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (1, 12))
    return model.generate(ids, max_new_tokens=4, do_sample=False)


def _ran(runtime) -> dict:
    """Experts module -> {phase: the modes its calls ran in}, as the runtime counted them."""
    return {name: {phase: set(row) for phase, row in layer["used"].items()}
            for name, layer in runtime.state["experts"].items()}


def _as_planned(ran: dict, plan) -> bool:
    return bool(ran) and all(ran[name] == {phase: {mode} for phase, mode in plan.runtime.expert_mode[name].items()}
                             for name in ran)


def test_each_layer_runs_each_phase_in_the_plans_mode_within_the_reserve(moe, tmp_path):
    folder, ref, plan = moe
    assert plan.main_device == 0 and plan.valid and plan.experts
    modes = plan.runtime.expert_mode
    assert set(modes) == set(plan.experts)
    assert {row["prefill"] for row in modes.values()} == {"fetch"}       # the profile makes both modes win somewhere
    assert {row["decode"] for row in modes.values()} == {"compute"}
    reserve = plan.runtime.buffers["streamed"] + plan.runtime.buffers["prefetch"]
    model, runtime = _attached(folder, plan, tmp_path)
    try:
        assert torch.equal(_generate(model), _generate(ref))
        ran = _ran(runtime)
        assert set(ran) == set(modes) and _as_planned(ran, plan), (ran, modes)
        t = runtime.traffic
        assert t.fetched > 0 and t.computed > 0                           # prefill fetched, decode computed
        assert 0 < runtime.peak_held <= reserve, (runtime.peak_held, reserve)
    finally:
        offload.detach(model)


def test_a_mode_forced_the_other_way_is_not_the_plans(moe, tmp_path):
    """The comparison above fails where the runtime runs another mode than the plan's (here forced through
    the plan's runtime section): it would catch a runtime that re-derives the mode."""
    folder, ref, plan = moe
    flipped = {name: {phase: "compute" if mode == "fetch" else "fetch" for phase, mode in row.items()}
               for name, row in plan.runtime.expert_mode.items()}
    spec = dataclasses.replace(plan.runtime, expert_mode=flipped)
    model, runtime = _attached(folder, dataclasses.replace(plan, runtime=spec), tmp_path)
    try:
        assert torch.equal(_generate(model), _generate(ref))
        ran = _ran(runtime)
        assert not _as_planned(ran, plan)
        assert all(ran[name] == {phase: {mode} for phase, mode in flipped[name].items()} for name in ran)
    finally:
        offload.detach(model)
