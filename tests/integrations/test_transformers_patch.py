"""``allocator.integrations.transformers.patch``: transformers' and accelerate's string device maps planned by the
planner, end to end.

Five small random models (llama, GPT-2 with tied embeddings, T5, ViT, Segformer) are saved to disk once per module
and loaded on this CPU machine with half of their size as the RAM budget (CPU main device, the rest on disk). Under
the patch, ``from_pretrained(device_map="auto")`` must load the planner's map, compute exactly what the fully
loaded model computes and keep at least as much in RAM as transformers' own map; after the patch transformers'
maps and the patched module attributes are what they were. Then: modes (``"sequential"`` is accelerate's map,
``"balanced"`` is the ``balanced`` strategy over the user's budgets), accelerate's ``load_checkpoint_and_dispatch``,
nesting, errors, the plain-call form, ``_no_placement_params`` and the transformers 4 path.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import importlib  # noqa: E402

import accelerate.big_modeling as big_modeling  # noqa: E402
import transformers.modeling_utils as modeling_utils  # noqa: E402
from accelerate.utils import get_max_memory as accelerate_get_max_memory  # noqa: E402

import allocator  # noqa: E402
import allocator.integrations.transformers as hf
from allocator.evaluate.memory import device_of  # noqa: E402
from models import DTYPE, SEED, SavedModel, tiny_specs  # noqa: E402

BUDGET_SHARE = 0.5
TOL = {"rtol": 1e-6, "atol": 1e-6}
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

try:
    tia = importlib.import_module("transformers.integrations.accelerate")
except ImportError:  # old transformers 4
    tia = None
needs5 = pytest.mark.skipif(
    TRANSFORMERS_MAJOR < 5, reason=f"transformers 5 route (_get_device_map); installed {transformers.__version__}")

# The attributes string device maps are routed through: transformers 5.24 and accelerate 1.15 (on 4.x:
# accelerate's two functions imported into modeling_utils).
PATCHED = tuple(
    (module, attr)
    for module, attr in (
        (tia, "_get_device_map"),
        (modeling_utils, "_get_device_map" if TRANSFORMERS_MAJOR >= 5 else "infer_auto_device_map"),
        (modeling_utils, "get_balanced_memory"),
        (big_modeling, "get_balanced_memory"),
        (big_modeling, "infer_auto_device_map"),
    )
    if module is not None and hasattr(module, attr)
)
# ``runtime="allocator"`` also swaps the ``dispatch_model`` that from_pretrained and load_checkpoint_and_dispatch call.
DISPATCH = tuple((module, "dispatch_model") for module in (tia, big_modeling)
                 if module is not None and hasattr(module, "dispatch_model"))
RESTORED = PATCHED + DISPATCH
BY_NAME = ("get_balanced_memory", "infer_auto_device_map", "dispatch_model")
"""Every attribute a patch may replace: each is the library's own again after the patch ends."""


MODELS = ("llama", "gpt2", "t5", "vit", "segformer")


class Case(SavedModel):
    """A saved model (tests/models.py) and transformers' own map for it."""

    def transformers_map(self, mode="auto") -> dict:
        return tia._get_device_map(self.meta, mode, dict(self.max_memory), None)


@pytest.fixture(scope="module")
def cases(tmp_path_factory, quiet):
    if TRANSFORMERS_MAJOR < 5:
        pytest.skip(f"the saved cases load with transformers 5's API; installed {transformers.__version__}")
    root = tmp_path_factory.mktemp("hf_patch_models")
    return {name: Case(name, *spec, root) for name, spec in tiny_specs().items()}


@pytest.fixture(autouse=True)
def no_patch_left():
    """Every test starts and ends with no live patch and the library's own functions in place."""
    originals = [getattr(module, attr) for module, attr in RESTORED]
    assert not hf._ACTIVE
    yield
    live = list(hf._ACTIVE)
    while hf.unpatch() is not None:
        pass
    assert not live, f"a test left patches on: {live}"
    assert all(getattr(m, a) is o for (m, a), o in zip(RESTORED, originals))


def _snapshot():
    return [getattr(module, attr) for module, attr in PATCHED]


def _same_objects(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


# -- end to end: from_pretrained under the patch ------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_from_pretrained_auto_loads_the_plan_and_restores_transformers(cases, name, tmp_path):
    case = cases[name]
    plan = allocator.plan(case.meta, dict(case.max_memory))
    assert plan.valid and set(plan.device_map.values()) == {"cpu", "disk"}, plan.explain()
    before, originals = case.transformers_map(), _snapshot()

    with hf.patch() as handle:
        assert {f"{m.__name__}.{a}" for m, a in PATCHED} <= set(handle.patched)
        assert all(getattr(m, a) is not o for (m, a), o in zip(PATCHED, originals))
        assert case.transformers_map() == plan.device_map
        model = case.load("auto", tmp_path / "ours")
        loaded = dict(model.hf_device_map)
        torch.testing.assert_close(case.logits(model), case.reference, **TOL)
    if loaded != plan.device_map:
        # transformers 5 plans the model before it ties its weights: accelerate's map of that model (the contract's
        # floor) can differ from the tied meta twin's (t5: all on disk), and so can the plan within the contract
        assert name == "t5", (loaded, plan.device_map)
        plan = allocator.plan(case.meta, dict(case.max_memory), objective="latency",
                              strategy=lambda problem: allocator.Placement(loaded, "loaded"))
        assert plan.valid, plan.violations

    assert _same_objects(_snapshot(), originals)
    after = case.transformers_map()
    assert list(after.items()) == list(before.items())  # same keys, same order, same devices
    theirs = case.load("auto", tmp_path / "theirs").hf_device_map
    assert list(theirs.items()) == list(before.items())

    ours_ram, their_ram = case.ram_resident(plan.device_map), case.ram_resident(theirs)
    assert ours_ram == plan.resident("cpu")
    ours_disk, their_disk = case.disk_tensors(plan.device_map), case.disk_tensors(theirs)
    # more bytes in RAM, or fewer tensors read from disk per forward (t5: 58 kB less in RAM, 34 tensors against 46)
    assert ours_ram >= their_ram or ours_disk < their_disk, (
        f"{name}: patched map keeps {ours_ram} B in RAM and reads {ours_disk} tensors, transformers' {their_ram} B "
        f"and {their_disk}")


def test_from_pretrained_sequential_is_accelerates_map(cases, tmp_path):
    case = cases["llama"]
    expected = accelerate.infer_auto_device_map(
        case.meta, dict(case.max_memory), no_split_module_classes=case.meta._no_split_modules)
    with hf.patch(strategy="reserve"):
        model = case.load("sequential", tmp_path / "seq")
    assert model.hf_device_map == expected
    torch.testing.assert_close(case.logits(model), case.reference, **TOL)


@pytest.mark.parametrize("name", MODELS)
def test_sequential_mode_reproduces_accelerate(cases, name):
    case = cases[name]
    expected = accelerate.infer_auto_device_map(
        case.meta, dict(case.max_memory), no_split_module_classes=case.meta._no_split_modules)
    with hf.patch(strategy="backfill"):
        assert case.transformers_map("sequential") == expected


def test_balanced_modes_plan_the_balanced_strategies_over_the_users_budgets(cases):
    assert hf.MODE_TO_STRATEGY == {
        "auto": None, "balanced": "balanced", "balanced_low_0": "balanced_low_0", "sequential": "sequential"}
    meta = cases["llama"].meta
    total = cases["llama"].problem.graph.total
    # Two (planned, not present) GPUs: transformers' balanced budgets would cap GPU 0 near half of the model.
    budgets = {0: int(0.9 * total), 1: int(0.9 * total), "cpu": total}
    expected = {mode: allocator.plan(meta, dict(budgets), strategy=mode).device_map
                for mode in ("balanced", "balanced_low_0")}
    reserve = allocator.plan(meta, dict(budgets), strategy="reserve").device_map
    given = dict(budgets)
    with hf.patch(strategy="reserve"):
        for mode in ("balanced", "balanced_low_0"):
            assert tia._get_device_map(meta, mode, given, None) == expected[mode], mode
        assert tia._get_device_map(meta, "auto", given, None) == reserve
    assert given == budgets
    assert expected["balanced"] != expected["balanced_low_0"]
    balanced = tia.get_balanced_memory(meta, max_memory=dict(budgets), no_split_module_classes=meta._no_split_modules)
    assert balanced[0] < budgets[0]  # the fudge the patch does not apply


# -- accelerate's load_checkpoint_and_dispatch --------------------------------------------------------------------

def test_load_checkpoint_and_dispatch_auto(cases, tmp_path):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    case = cases["llama"]
    with init_empty_weights():
        model = case.cls(case.config)
    no_split = sorted(model._no_split_modules)
    expected = allocator.plan(model, dict(case.max_memory), no_split_module_classes=no_split).device_map
    assert set(expected.values()) == {"cpu", "disk"}
    given = dict(case.max_memory)
    with hf.patch():
        model = load_checkpoint_and_dispatch(
            model, case.path, device_map="auto", max_memory=given, no_split_module_classes=no_split,
            offload_folder=str(tmp_path / "offload"), dtype=DTYPE,
        )
    assert given == case.max_memory
    assert model.hf_device_map == expected
    torch.testing.assert_close(case.logits(model), case.reference, **TOL)


def test_accelerate_sequential_and_balanced_low_0_modes(cases):
    meta = cases["llama"].meta
    budgets = dict(cases["llama"].max_memory)
    with hf.patch(strategy="reserve"):
        # load_checkpoint_and_dispatch(device_map="sequential") skips get_balanced_memory: accelerate's map.
        no_split = sorted(meta._no_split_modules)
        assert big_modeling.infer_auto_device_map(meta, dict(budgets), no_split) == (
            accelerate.utils.infer_auto_device_map(meta, dict(budgets), no_split))
        # "balanced_low_0": get_balanced_memory(low_zero=True) returns the user's budgets and the mode.
        got = big_modeling.get_balanced_memory(meta, max_memory=dict(budgets), low_zero=True)
        assert got == budgets
        assert big_modeling.infer_auto_device_map(meta, got) == allocator.plan(
            meta, budgets, strategy="balanced_low_0").device_map
        got = big_modeling.get_balanced_memory(meta, max_memory=dict(budgets))
        assert big_modeling.infer_auto_device_map(meta, got) == allocator.plan(
            meta, budgets, strategy="reserve").device_map


def test_each_hook_plans_for_its_loading_path(cases, monkeypatch):
    """accelerate's namespace plans with loader="accelerate", transformers' _get_device_map with "transformers"."""
    meta = cases["gpt2"].meta
    budgets = dict(cases["gpt2"].max_memory)
    loaders = []
    real = hf.build_problem   # each load reads the model once, as its loading path says

    def recording(*args, options, **kwargs):
        loaders.append(options.loader)
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(hf, "build_problem", recording)
    with hf.patch():
        got = big_modeling.get_balanced_memory(meta, max_memory=dict(budgets))
        big_modeling.infer_auto_device_map(meta, got)
        five = tia is not None and hasattr(modeling_utils, "_get_device_map")
        if five:
            modeling_utils._get_device_map(meta, "auto", dict(budgets), None)
    assert loaders == ["accelerate", "transformers"] if five else ["accelerate"]
    with pytest.raises(allocator.InvalidOption, match="loader"):
        hf.patch(loader="accelerate")


# -- the patch itself ----------------------------------------------------------------------------------------------

def test_nesting_restores_the_outer_patch(cases):
    case = cases["vit"]
    originals = _snapshot()
    with hf.patch(strategy="sequential") as outer:
        outer_attrs = _snapshot()
        with hf.patch(strategy="backfill") as inner:
            assert all(a is not b for a, b in zip(_snapshot(), outer_attrs))
            assert case.transformers_map() == allocator.plan(case.meta, case.max_memory, strategy="backfill").device_map
            assert hf._ACTIVE == [outer, inner]
        assert _same_objects(_snapshot(), outer_attrs)
        assert case.transformers_map() == allocator.plan(case.meta, case.max_memory, strategy="sequential").device_map
        assert outer.active and not inner.active
    assert _same_objects(_snapshot(), originals)


def test_unpatching_the_outer_patch_first_still_restores_the_originals():
    originals = _snapshot()
    outer = hf.patch()
    inner = hf.patch()
    inner_attrs = _snapshot()
    outer.unpatch()
    assert _same_objects(_snapshot(), inner_attrs) and inner.active
    inner.unpatch()
    inner.unpatch()  # idempotent
    assert _same_objects(_snapshot(), originals)


@pytest.mark.parametrize("how", ["exit", "unpatch", "raise"])
def test_runtime_allocator_restores_every_attribute_it_replaced(how):
    """``patch(runtime="allocator")`` swaps ``dispatch_model`` too: it is listed in ``Patch.patched`` and is the
    library's own again after the block ends, ``unpatch()`` or an exception."""
    originals = {(m, a): getattr(m, a) for m, a in RESTORED}
    handle = hf.patch(runtime="allocator")
    try:
        ours = {f"{m.__name__}.{a}" for m, a in RESTORED}
        assert ours <= set(handle.patched)  # diffusers' loaders too where diffusers is installed
        # beyond those: diffusers' loaders, and accelerate's functions imported by name elsewhere (peft.peft_model)
        assert all(name.startswith("diffusers.") or name.rpartition(".")[2] in BY_NAME
                   for name in set(handle.patched) - ours)
        saved = [(s.module, s.attribute, o) for s, o in zip(handle._swaps, handle._saved)]
        assert all(getattr(m, a) is not o for (m, a), o in originals.items())
        if how == "raise":
            with pytest.raises(RuntimeError, match="boom"):
                with handle:
                    raise RuntimeError("boom")
        elif how == "exit":
            with handle:
                pass
    finally:
        handle.unpatch()
    assert all(getattr(m, a) is o for (m, a), o in originals.items())
    assert all(getattr(m, a) is o for m, a, o in saved)
    assert not hf._ACTIVE


def test_exception_inside_the_block_unpatches():
    originals = _snapshot()
    with pytest.raises(RuntimeError, match="boom"):
        with hf.patch():
            assert not _same_objects(_snapshot(), originals)
            raise RuntimeError("boom")
    assert _same_objects(_snapshot(), originals)
    assert not hf._ACTIVE


def test_planner_error_inside_from_pretrained_path_unpatches(cases):
    originals = _snapshot()
    with pytest.raises(allocator.InfeasiblePlacement):
        with hf.patch(strict=True):
            tia._get_device_map(cases["gpt2"].meta, "auto", {"cpu": 10}, None)
    assert _same_objects(_snapshot(), originals)
    # without strict, the map transformers would use (accelerate's own), with a warning naming the minimum budget
    with pytest.warns(UserWarning, match="No valid plan exists"):
        with hf.patch():
            theirs = tia._get_device_map(cases["gpt2"].meta, "auto", {"cpu": 10}, None)
    assert theirs == tia._get_device_map(cases["gpt2"].meta, "auto", {"cpu": 10}, None)


def test_plain_call_and_module_unpatch(cases):
    originals = _snapshot()
    case = cases["t5"]
    handle = hf.patch(strategy="reserve")
    assert handle.active and "transformers.modeling_utils._get_device_map" in handle.patched
    assert modeling_utils._get_device_map is tia._get_device_map  # from_pretrained's name is the patched one
    assert case.transformers_map() == allocator.plan(case.meta, case.max_memory, strategy="reserve").device_map
    handle.unpatch()
    assert _same_objects(_snapshot(), originals) and not handle.active

    second = hf.patch()
    assert hf.unpatch() is second
    assert hf.unpatch() is None
    assert _same_objects(_snapshot(), originals)


def test_bad_arguments_patch_nothing():
    originals = _snapshot()
    with pytest.raises(allocator.InvalidOption, match="unknown strategy"):
        hf.patch(strategy="greedy")
    with pytest.raises(allocator.InvalidOption, match="max_memory"):
        hf.patch(max_memory={"cpu": 1})
    assert _same_objects(_snapshot(), originals) and not hf._ACTIVE


def test_budgets_as_transformers_reads_them_and_never_modified(cases, monkeypatch):
    meta = cases["llama"].meta
    given = {"cpu": "700KB"}
    with hf.patch():
        assert tia._get_device_map(meta, "auto", given, None) == allocator.plan(meta, {"cpu": 700_000}).device_map
        # no budgets: this machine's free memory as transformers reads it, whatever the machine has
        assert tia._get_device_map(meta, "auto", None, None) == tia._get_device_map(
            meta, "auto", tia.get_max_memory(None), None)
    assert given == {"cpu": "700KB"}
    # and on a machine without accelerators (made one here, so the check holds on a GPU machine too)
    machine = tia.get_max_memory

    def without_accelerators(max_memory=None):
        return {"cpu": 2**30} if max_memory is None else machine(max_memory)

    monkeypatch.setattr(tia, "get_max_memory", without_accelerators)
    with hf.patch():
        assert tia._get_device_map(meta, "auto", None, None) == {"": "cpu"}  # 1 GiB of RAM holds 1.5 MB


def test_declared_ties_are_made_before_planning_an_untied_model(cases):
    """transformers 5 plans before it ties: the map of the untied model is the map of the tied one, untouched."""
    case = cases["gpt2"]
    with torch.device("meta"):
        untied = case.cls(case.config)
    untied.lm_head.weight = torch.nn.Parameter(torch.empty_like(untied.lm_head.weight))
    assert untied.all_tied_weights_keys == {"lm_head.weight": "transformer.wte.weight"}
    with hf.patch():
        got = tia._get_device_map(untied, "auto", dict(case.max_memory), None)
    assert got == allocator.plan(case.meta, case.max_memory).device_map
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_hf_quantizer_sizes_budgets_and_validation(cases):
    class Quantizer:
        """Stands for a transformers ``HfQuantizer``: 1-byte matrices, 10% of every budget held back."""

        def __init__(self):
            self.validated = []

        def param_element_size(self, model, name, param):
            return 1 if param.dim() == 2 else param.element_size()

        def adjust_max_memory(self, max_memory):
            return {device: int(0.9 * size) for device, size in max_memory.items()}

        def validate_environment(self, *args, device_map=None, **kwargs):
            self.validated.append(device_map)

    meta, budgets = cases["llama"].meta, {"cpu": cases["llama"].max_memory["cpu"] // 2}
    quantizer = Quantizer()
    with hf.patch():
        got = tia._get_device_map(meta, "auto", dict(budgets), quantizer)
    assert got == allocator.plan(meta, budgets, hf_quantizer=Quantizer()).device_map
    assert got != allocator.plan(meta, budgets).device_map
    assert quantizer.validated == [got]


def test_dict_device_maps_go_to_transformers(cases):
    meta = cases["llama"].meta
    with hf.patch():
        assert tia._get_device_map(meta, {"": "cpu"}, None, None) == {"": "cpu"}


# -- _no_placement_params -----------------------------------------------------------------------------------------

def _no_placement_model():
    """A transformers model whose no-split blocks hold a large ``big.weight`` listed in ``_no_placement_params``."""
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    class NoPlacementConfig(PretrainedConfig):
        model_type = "allocator_no_placement_test"

        def __init__(self, hidden=8, vocab=512, layers=3, **kwargs):
            super().__init__(**kwargs)
            self.hidden, self.vocab, self.layers = hidden, vocab, layers

    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.big = nn.Embedding(config.vocab, config.hidden)
            self.proj = nn.Linear(config.hidden, config.hidden)

        def forward(self, ids, hidden):
            # As models declaring _no_placement_params do: the table may live outside the device map.
            return self.proj(hidden + self.big(ids.to(self.big.weight.device)).to(hidden.device))

    class NoPlacementModel(PreTrainedModel):
        config_class = NoPlacementConfig
        base_model_prefix = "np"
        _no_split_modules = ["Block"]
        _no_placement_params = ["big.weight"]

        def __init__(self, config):
            super().__init__(config)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
            self.head = nn.Linear(config.hidden, config.hidden)
            self.post_init()

        def forward(self, ids):
            hidden = torch.zeros(*ids.shape, self.config.hidden)
            for block in self.blocks:
                hidden = block(ids, hidden)
            return self.head(hidden)

    return NoPlacementModel, NoPlacementConfig()


@needs5
def test_no_placement_params_are_left_out_only_when_no_accelerator_holds_them(quiet, tmp_path):
    cls, config = _no_placement_model()
    with torch.device("meta"):
        model = cls(config)
    bigs = [f"blocks.{i}.big.weight" for i in range(3)]  # 16 KiB each; every other tensor: 288 B

    def patched_map(budgets):
        with hf.patch():
            return tia._get_device_map(model, "auto", dict(budgets), None)

    # A GPU too small for one block: the plain plan leaves the blocks in RAM; the patch leaves the big
    # embeddings out of the map (transformers loads them in RAM) and fits everything else on GPU 0.
    small = {0: 4000, "cpu": 10**6}
    device_map = patched_map(small)
    assert all(device_of(b, device_map) is None for b in bigs), device_map
    names = [n for n, _ in model.named_parameters()]
    assert {device_of(n, device_map) for n in names if n not in bigs} == {0}, device_map
    assert not any(b == k or b.startswith(k + ".") for b in bigs for k in device_map)
    assert list(device_map) == ["blocks.0.proj", "blocks.1.proj", "blocks.2.proj", "head"]  # model order
    assert device_of("blocks.0.big.weight", allocator.plan(model, small).device_map) == "cpu"

    # transformers honours such a map: what it leaves out is loaded in RAM. (No GPU here: the GPU entries are
    # moved to RAM and disk, so that accelerate's hooks stream part of the model.)
    torch.manual_seed(SEED)
    reference_model = cls(config).eval()
    reference_model.save_pretrained(tmp_path / "np")
    ids = torch.randint(0, config.vocab, (2, 5), generator=torch.Generator().manual_seed(SEED))
    on_host = {key: "disk" if key in ("blocks.1.proj", "head") else "cpu" for key in device_map}
    loaded = cls.from_pretrained(tmp_path / "np", device_map=on_host, offload_folder=str(tmp_path / "off")).eval()
    assert all(loaded.get_parameter(b).device.type == "cpu" for b in bigs)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), reference_model(ids), **TOL)

    # When the GPU holds them, or there is no accelerator, they are planned like any tensor.
    for budgets in ({0: 10**6, "cpu": 10**6}, {"cpu": 40_000}):
        assert patched_map(budgets) == allocator.plan(model, dict(budgets)).device_map


def _reads_per_load(monkeypatch, model, budgets) -> int:
    """How many times one patched ``from_pretrained`` map (transformers 5's ``_get_device_map``) reads ``model``."""
    from allocator.problem import build

    reads = []
    real = build.build_graph
    monkeypatch.setattr(build, "build_graph", lambda *a, **k: reads.append(1) or real(*a, **k))
    with hf.patch():
        tia._get_device_map(model, "auto", dict(budgets), None)
    return len(reads)


@needs5
@pytest.mark.parametrize("budgets", [
    {0: 10**6, "cpu": 10**6},              # everything on GPU 0
    {0: 10**6, 1: 10**6, "cpu": 10**6},    # two GPUs: balanced
    {0: 20_000, 1: 20_000, "cpu": 10**6},  # two GPUs too small: balanced offloads, then the contract's plan
], ids=["one-gpu", "balanced", "balanced-then-auto"])
def test_a_patched_load_reads_the_model_once(quiet, monkeypatch, budgets):
    cls, config = _no_placement_model()
    plain = type("PlainModel", (cls,), {"_no_placement_params": []})   # every tensor planned as usual
    with torch.device("meta"):
        model = plain(config)
    assert _reads_per_load(monkeypatch, model, budgets) == 1


@needs5
def test_a_patched_load_that_leaves_no_placement_params_out_reads_the_model_once(quiet, monkeypatch):
    cls, config = _no_placement_model()
    with torch.device("meta"):
        model = cls(config)
    assert _reads_per_load(monkeypatch, model, {0: 4000, "cpu": 10**6}) == 1


@needs5
@pytest.mark.parametrize("runtime", ["accelerate", "allocator"])
@pytest.mark.parametrize("generation", [None, allocator.GenerationBudget(1, 64)], ids=["forward", "generate"])
def test_one_read_and_one_plan_per_patched_from_pretrained_and_per_plan_call(cases, monkeypatch, tmp_path, runtime,
                                                                           generation):
    """A patched ``from_pretrained(device_map="auto")`` reads the model once and plans once (one ``planned`` on one
    problem, no ``plan()`` call of its own); ``allocator.plan`` reads it once too, under either runtime, with and
    without a generation budget."""
    from allocator.problem import build

    reads, plans = [], []
    real_read, real_planned = build.build_graph, hf.planned
    monkeypatch.setattr(build, "build_graph", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    monkeypatch.setattr(hf, "planned", lambda *a, **k: plans.append(1) or real_planned(*a, **k))
    monkeypatch.setattr(allocator.api, "plan", lambda *a, **k: pytest.fail("a patched load called plan()"))
    case = cases["llama"]
    with hf.patch(runtime=runtime, generation=generation):
        model = case.load("auto", tmp_path / "offload")
    assert model is not None and (len(reads), len(plans)) == (1, 1)
    reads.clear()
    monkeypatch.undo()
    monkeypatch.setattr(build, "build_graph", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    allocator.plan(case.meta, dict(case.max_memory), runtime=runtime, generation=generation)
    assert len(reads) == 1


def test_skip_keys_reach_dispatch_model(cases, tmp_path):
    """``_skip_keys_device_placement`` is transformers' to pass to ``dispatch_model``; the patch leaves it alone."""
    case = cases["llama"]
    with hf.patch():
        model = case.load("auto", tmp_path / "skip")
    hooks = [m._hf_hook for m in model.modules() if hasattr(m, "_hf_hook") and hasattr(m._hf_hook, "skip_keys")]
    assert hooks and all(h.skip_keys == model._skip_keys_device_placement for h in hooks)


# -- transformers 4: accelerate's functions imported into transformers.modeling_utils -----------------------------

def test_transformers4_names_in_modeling_utils_are_patched_when_present(cases, monkeypatch):
    """The 4.x route, simulated on 5.x: ``modeling_utils`` holding accelerate's two functions, called as 4.x does."""
    monkeypatch.setattr(modeling_utils, "get_balanced_memory", accelerate.utils.get_balanced_memory, raising=False)
    monkeypatch.setattr(modeling_utils, "infer_auto_device_map", accelerate.utils.infer_auto_device_map, raising=False)
    case = cases["gpt2"]
    meta, no_split = case.meta, sorted(case.meta._no_split_modules)
    with hf.patch() as handle:
        assert "transformers.modeling_utils.infer_auto_device_map" in handle.patched
        budgets = modeling_utils.get_balanced_memory(
            meta, dtype=DTYPE, low_zero=False, max_memory=dict(case.max_memory), no_split_module_classes=no_split)
        auto = modeling_utils.infer_auto_device_map(
            meta, dtype=DTYPE, no_split_module_classes=no_split, special_dtypes={}, max_memory=budgets)
        sequential = modeling_utils.infer_auto_device_map(
            meta, dtype=DTYPE, no_split_module_classes=no_split, max_memory=accelerate_get_max_memory(
                dict(case.max_memory)))
    assert auto == allocator.plan(meta, case.max_memory).device_map
    assert sequential == accelerate.utils.infer_auto_device_map(
        meta, dict(case.max_memory), no_split_module_classes=no_split, dtype=DTYPE)
    assert modeling_utils.infer_auto_device_map is accelerate.utils.infer_auto_device_map


@pytest.mark.skipif(
    TRANSFORMERS_MAJOR != 4,
    reason=f"transformers 4 route (from_pretrained calling accelerate's get_balanced_memory / infer_auto_device_map "
           f"through transformers.modeling_utils) needs transformers 4; installed {transformers.__version__}",
)
def test_transformers4_from_pretrained(tmp_path, quiet):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=1000, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path / "llama")
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    max_memory = {"cpu": int(BUDGET_SHARE * allocator.build_problem(meta, {"cpu": 0}).graph.total)}
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        reference = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()(input_ids=ids).logits
    originals = (modeling_utils.get_balanced_memory, modeling_utils.infer_auto_device_map)
    with hf.patch() as handle:
        assert "transformers.modeling_utils.infer_auto_device_map" in handle.patched
        model = LlamaForCausalLM.from_pretrained(
            tmp_path / "llama", device_map="auto", max_memory=dict(max_memory), offload_folder=str(tmp_path / "off"))
    assert model.hf_device_map == allocator.plan(meta, max_memory).device_map
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, reference, **TOL)
    assert modeling_utils.get_balanced_memory is originals[0]
    assert modeling_utils.infer_auto_device_map is originals[1]


def test_patched_infer_auto_device_map_verbose_shows_the_decisions(caplog):
    """accelerate's infer_auto_device_map(verbose=True) prints; patched, our INFO records are made visible."""
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    with hf.patch():
        big_modeling.infer_auto_device_map(model, {"cpu": 10**6})
        assert not any("main device" in r.getMessage() for r in caplog.records)
        big_modeling.infer_auto_device_map(model, {"cpu": 10**6}, verbose=True)
    assert any("strategy " in r.getMessage() and "main device" in r.getMessage() for r in caplog.records)
