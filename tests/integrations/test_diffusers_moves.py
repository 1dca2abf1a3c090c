"""Issue #47, the running half: a tiny random FluxPipeline (CLIP and T5 text encoders, transformer, VAE) saved by
``save_pretrained`` and loaded by ``DiffusionPipeline.from_pretrained(device_map="balanced")`` under
``allocator.patch()``, with a pipeline plan by hand: the transformer split over the accelerator, RAM and the disk
(its own map), T5 and the VAE living in RAM and moved onto the accelerator when they run (``execution == "moved"``,
carried out by :mod:`allocator.offload.moved`), CLIP computed on the CPU where it lives (``"cpu"``). Each component
is loaded as planned, and the images equal the pipeline's in RAM. (A component resident on the accelerator,
``{"": 0}``, is diffusers' own loading and needs a GPU.)

No GPU here: the plan is made for accelerator 0 and loaded with the accelerator stood in by RAM and RAM by the disk
(:func:`_stood_in`, as ``test_diffusers_pipeline.py`` does), so that every offloaded part runs from
``offload_folder``; a moved component lives in RAM either way. Under ``patch(runtime="allocator",
offload_device="stand-in")`` the split transformer runs our runtime on :class:`allocator.offload.StandInDevice` and
the moves go to a stand-in too: its tensors are tagged while a component is "on the accelerator"."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

pytest.importorskip("diffusers")

import allocator  # noqa: E402
from allocator import offload  # noqa: E402
from allocator.offload.devices import on_stand_in  # noqa: E402
from allocator.offload.moved import CpuHook, MoveHook, moves_of  # noqa: E402
from flux_pipeline import FLUX_CALL, save_flux_pipeline  # noqa: E402

pytestmark = pytest.mark.slow
TOL = dict(rtol=1e-5, atol=1e-5)
"""Images in float32 from the same weights: only the order of float additions may differ (offloaded weights are
read back bit for bit)."""
MOVED = ("text_encoder_2", "vae")
ON_CPU = "text_encoder"


def _stood_in(where):
    """A device of the plan as this machine loads it: the accelerator stood in by RAM, RAM by the disk."""
    if isinstance(where, dict):
        return {k: _stood_in(d) for k, d in where.items()}
    return "disk" if where in ("cpu", "disk") else "cpu"


def _with(plan, **fields):
    """``plan`` with ``fields`` replaced; ``execution`` and ``runs_on`` set on a ``PipelinePlan`` that does not have
    them as fields yet (before the planner's side of issue #47 lands)."""
    known = {f.name for f in dataclasses.fields(plan)}
    copy = dataclasses.replace(plan, **{k: v for k, v in fields.items() if k in known})
    extra = {k: v for k, v in vars(plan).items() if k not in known}
    for key, value in {**extra, **fields}.items():
        if key not in known:
            object.__setattr__(copy, key, value)
    return copy


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, the pipeline in RAM, the plan by hand, the same plan as this machine loads it)."""
    import diffusers

    folder = save_flux_pipeline(tmp_path_factory.mktemp("flux"))
    ram = diffusers.FluxPipeline.from_pretrained(folder)
    sizes = {n: sum(t.nbytes for t in m.state_dict().values()) for n, m in ram.components.items()
             if isinstance(m, torch.nn.Module)}
    with torch.device("meta"):
        meta = diffusers.FluxTransformer2DModel.from_config(ram.transformer.config)
    t = sizes["transformer"]
    own = {0: int(0.45 * t), "cpu": int(0.3 * t), "disk": 4 * t}
    split = allocator.plan(meta, own, loader="accelerate")
    assert split.valid and {0, "cpu", "disk"} <= set(split.device_map.values())
    real = allocator.plan_pipeline(folder, {0: 4 * t, "cpu": 4 * t})
    components = {"transformer": dict(split.device_map), **dict.fromkeys((*MOVED, ON_CPU), "cpu")}
    plan = _with(real, components=components, plans={"transformer": split}, given={"transformer": own}, unplaced=(),
                 peak={},   # by hand: nothing left unplaced, no peak over its budget
                 execution={"transformer": "split", **dict.fromkeys(MOVED, "moved"), ON_CPU: "cpu"},
                 runs_on={"transformer": 0, "text_encoder": 0, "text_encoder_2": 0, "vae": 0})
    stood = _with(plan, components={n: w if n in (*MOVED, ON_CPU) else _stood_in(w) for n, w in components.items()},
                  runs_on=dict.fromkeys(components, "cpu"))
    return folder, ram, plan, stood


def _load(folder, stood, monkeypatch, tmp_path, **options):
    import diffusers

    from allocator.integrations import diffusers as integration

    monkeypatch.setattr(integration, "plan_pipeline", lambda *a, **k: stood)
    with allocator.patch(**options):
        return diffusers.FluxPipeline.from_pretrained(folder, device_map="balanced",
                                                      max_memory={0: "1MiB", "cpu": "1MiB"},
                                                      offload_folder=str(tmp_path / "offload"))


def _image(pipe):
    with torch.no_grad():
        return pipe(generator=torch.Generator().manual_seed(3), **FLUX_CALL).images


def _check_loaded_as_planned(pipe, stood):
    assert pipe.transformer.hf_device_map == stood.components["transformer"]
    assert "disk" in pipe.transformer.hf_device_map.values()
    for name in MOVED:
        hook = getattr(pipe, name)._hf_hook
        assert isinstance(hook, MoveHook) and hook.name == name and hook.runs_on == stood.runs_on[name]
        assert all(p.device.type == "cpu" for p in getattr(pipe, name).parameters())
    hook = getattr(pipe, ON_CPU)._hf_hook
    assert isinstance(hook, CpuHook) and hook.back and not hasattr(hook, "execution_device")
    assert all(isinstance(c._hf_hook, CpuHook) for c in getattr(pipe, ON_CPU).children())


def test_patched_pipeline_loads_the_plan_and_moves_its_encoders(saved, monkeypatch, tmp_path, caplog):
    """``patch()``: accelerate's hooks run the split transformer from the disk, T5 and the VAE are moved (the VAE
    sends T5 back: one moved component on a device at a time), CLIP computes on the CPU, and the image equals the
    pipeline in RAM."""
    folder, ram, _, stood = saved
    with caplog.at_level(logging.INFO, logger="allocator"):
        pipe = _load(folder, stood, monkeypatch, tmp_path)
    said = [r.getMessage() for r in caplog.records if "are moved whole onto the device" in r.getMessage()]
    assert len(said) == 1 and all(name in said[0] for name in MOVED), said   # what diffusers' loading cannot say
    _check_loaded_as_planned(pipe, stood)
    moves = moves_of(pipe)
    assert moves is not None and set(moves.hooks) == set(MOVED) and moves.device is None
    torch.testing.assert_close(_image(pipe), _image(ram), **TOL)
    sizes = {n: sum(t.nbytes for t in [*getattr(ram, n).parameters(), *getattr(ram, n).buffers()]) for n in MOVED}
    assert dict(moves.moves) == dict.fromkeys(MOVED, 1)
    assert moves.moved == sum(sizes.values())   # T5's tied embedding once
    assert moves.on == {"cpu": "vae"}   # T5, the transformer, then the VAE (T5 sent back)
    assert getattr(pipe, ON_CPU)._hf_hook.calls == 1
    torch.testing.assert_close(_image(pipe), _image(ram), **TOL)
    assert dict(moves.moves) == dict.fromkeys(MOVED, 2)


def test_patched_pipeline_runs_the_plan_on_the_stand_in(saved, monkeypatch, tmp_path):
    """``patch(runtime="allocator", offload_device="stand-in")``: the split transformer runs our runtime on the
    stand-in (its offloaded blocks staged from the disk at each step), the moved components go onto a stand-in
    (their weights tagged while there, plain in RAM once sent back), and the image equals the pipeline in RAM."""
    folder, ram, _, stood = saved
    pipe = _load(folder, stood, monkeypatch, tmp_path, runtime="allocator", offload_device="stand-in")
    _check_loaded_as_planned(pipe, stood)
    runtime = offload.runtime_of(pipe.transformer)
    assert runtime is not None and isinstance(runtime.device, offload.StandInDevice)
    moves = moves_of(pipe)
    assert isinstance(moves.device, offload.StandInDevice)
    try:
        image = _image(pipe)
        torch.testing.assert_close(image, _image(ram), **TOL)
        assert runtime.device.staged > 0 and dict(moves.moves) == dict.fromkeys(MOVED, 1)
        assert all(on_stand_in(p) for p in pipe.vae.parameters())                  # on the (stand-in) accelerator
        assert not any(on_stand_in(p) for n in (*MOVED[:1], ON_CPU) for p in getattr(pipe, n).parameters())
        assert getattr(pipe, ON_CPU)._hf_hook.calls == 1   # computed where it lives: never moved
    finally:
        offload.detach(pipe.transformer)


def test_the_patch_plans_the_pipeline_at_its_diffusion_budget_and_loads_what_it_planned(saved, monkeypatch, tmp_path):
    """No plan by hand: ``patch(diffusion=DiffusionBudget(16, 16, steps=2))`` plans the pipeline with
    ``plan_pipeline(budget=..., balanced=True)`` over a GPU budget below the transformer and a RAM budget below the
    pipeline's size; each component is loaded as that plan says (stood in as this machine loads it), and the image
    equals the pipeline in RAM."""
    import diffusers

    from allocator.integrations import diffusers as integration

    folder, ram, _, _ = saved
    sizes = {n: sum(t.nbytes for t in m.state_dict().values()) for n, m in ram.components.items()
             if isinstance(m, torch.nn.Module)}
    total, gpu = sum(sizes.values()), int(0.5 * sizes["transformer"])
    budget = {0: gpu, "cpu": int(0.6 * total), "disk": 4 * total}
    diffusion = allocator.DiffusionBudget(16, 16, steps=2, text_tokens=8)
    real, seen = integration.plan_pipeline, []

    def stood_in(*args, **kwargs):
        seen.append(kwargs)
        plan = real(*args, **kwargs)
        seen.append(plan)
        return _with(plan, components={n: _stood_in(w) if plan.execution[n] in ("split", "resident") else w
                                       for n, w in plan.components.items()},
                     runs_on=dict.fromkeys(plan.components, "cpu"),
                     given={n: {_stood_in(d): b for d, b in g.items()} for n, g in plan.given.items()})

    monkeypatch.setattr(integration, "plan_pipeline", stood_in)
    with allocator.patch(diffusion=diffusion):
        pipe = diffusers.FluxPipeline.from_pretrained(folder, device_map="balanced", max_memory=dict(budget),
                                                      offload_folder=str(tmp_path / "offload"))
    asked, plan = seen
    assert asked["budget"] is diffusion and asked["balanced"] is True
    assert plan.valid and plan.budget == diffusion
    # below the pipeline's size: the transformer split over the GPU, RAM and the disk, the VAE moved onto the GPU
    # when it runs, the encoders computed on the CPU (their prices in the plan's decisions)
    assert {"split", "moved", "cpu"} <= set(plan.execution.values()), plan.explain()
    assert "disk" in plan.components["transformer"].values()
    for name, how in plan.execution.items():
        module = getattr(pipe, name)
        if how == "moved":
            assert isinstance(module._hf_hook, MoveHook), name
        elif how == "cpu":
            assert isinstance(module._hf_hook, CpuHook), name
        elif how == "split":
            assert module.hf_device_map == _stood_in(plan.components[name]), name
    torch.testing.assert_close(_image(pipe), _image(ram), **TOL)


def test_the_patch_refuses_a_diffusion_budget_of_another_type():
    with pytest.raises(allocator.InvalidOption, match="DiffusionBudget"):
        allocator.patch(diffusion=(1024, 1024))
