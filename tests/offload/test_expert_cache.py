"""The cache of recently routed experts (issue #39): ``expert_cache=`` slots decided by the plan, counted in the main
device's peak, taken from resident experts' room only, and run by :mod:`allocator.offload.expert_cache` so that an
expert routed again is not read or copied again."""

from __future__ import annotations

import json

import pytest
import torch

import allocator
from allocator import offload
from allocator.errors import InvalidOption
from allocator.evaluate.experts import resident_bytes
from allocator.evaluate.memory import map_runs
from allocator.evaluate.tiers import fast_bytes
from allocator.evaluate.validate import check
from allocator.integrations import transformers as hf
from allocator.offload.expert_cache import ExpertCache
from allocator.report.runtime import Runtime

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=128, head_dim=16, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
SLOTS = 16   # one decoding step routes at most 8 layers x top-2 offloaded experts: they all stay cached


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, the model in RAM, the model on the meta device, a RAM budget of 60 % of its bytes)."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    config = AutoConfig.for_model("qwen3_moe", **CONFIG)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    return folder, ref, meta, {"cpu": int(total * 0.6)}


def _loaded(folder, plan, tmp, device=None):
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=plan.device_map, offload_folder=tmp,
                                                 experts_implementation="eager").eval()
    return model, offload.attach(model, plan, device=device)


@pytest.mark.slow
@pytest.mark.parametrize("device", [None, "stand-in"])
def test_a_cached_expert_is_not_read_again(saved, device, tmp_path):
    """The same token twice: the second forward finds every offloaded expert it routes in the cache, reads and
    copies nothing, and equals the eager forward; without the cache the second forward reads them again."""
    folder, ref, meta, budgets = saved
    ids = torch.tensor([[5]])
    with torch.no_grad():
        expected = ref(input_ids=ids, use_cache=False).logits
    reads = {}
    for slots in (0, SLOTS):
        plan = allocator.plan(meta, dict(budgets), runtime="allocator", expert_cache=slots)
        assert plan.runtime.expert_cache == slots
        model, runtime = _loaded(folder, plan, tmp_path / f"o{slots}", device)
        try:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
                t = runtime.traffic
                before = (t.read, t.copied, t.fetched, t.cache_hits, t.resident, t.routed)
                got = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(got, expected)   # float32 defaults: rtol 1.3e-6, atol 1e-5
            read, copied, fetched, hits, resident, routed = (a - b for a, b in zip(
                (t.read, t.copied, t.fetched, t.cache_hits, t.resident, t.routed), before))
            reads[slots] = read
            assert routed - resident > 0           # offloaded experts were routed: else nothing is tested
            if slots:
                assert hits == routed - resident and fetched == 0 and read == 0 and copied == 0
                assert runtime.state["expert_cache"] == slots
            else:
                assert hits == 0 and fetched == routed - resident and read > 0
                assert (device is None) or copied > 0
        finally:
            offload.detach(model)
    assert reads[SLOTS] < reads[0]


def test_the_plans_peak_counts_the_cache_and_never_overcommits(saved):
    folder, ref, meta, budgets = saved
    plain = allocator.plan(meta, dict(budgets), runtime="allocator")
    plan = allocator.plan(meta, dict(budgets), runtime="allocator", expert_cache=SLOTS)
    size = plan.runtime.buffers["expert_cache"] // SLOTS
    assert size > 0 and plan.runtime.buffers["expert_cache"] == SLOTS * size
    assert plain.runtime.expert_cache == 0 and plain.runtime.buffers["expert_cache"] == 0
    main = plan.main_device
    mapped = check(plan.problem, plan.device_map)[1].peak[main]
    held = resident_bytes(plan.problem, plan.placement).get(main, 0)
    assert plan.peak[main] == mapped + held + plan.runtime.buffers["expert_cache"]   # the cache is in the peak
    assert plan.peak[main] <= budgets["cpu"] and plain.peak[main] <= budgets["cpu"]
    # its room came from resident experts: as many fewer of them as the slots hold
    residents = sum(row.count(main) for row in plan.experts.values())
    assert sum(row.count(main) for row in plain.experts.values()) - residents == SLOTS


@pytest.mark.parametrize("budgets", [{"cpu": 0.3}, {"cpu": 0.6}, {0: 0.3, "cpu": 0.5}, {0: 0.5, "cpu": 0.3}])
def test_the_cache_never_places_worse(saved, budgets):
    """The map (every part that runs for every token, and the experts modules' devices) is the plan's without the
    cache: the same bytes on the fastest tier and on disk; only resident experts give their room."""
    folder, ref, meta, _ = saved
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    budgets = {d: int(total * f) for d, f in budgets.items()}
    plain = allocator.plan(meta, dict(budgets), runtime="allocator")
    try:
        plan = allocator.plan(meta, dict(budgets), runtime="allocator", expert_cache=4)
    except InvalidOption:
        pytest.skip("4 slots do not fit in this budget")
    assert plan.device_map == plain.device_map
    g = plan.problem.graph
    fast = [fast_bytes(p.problem, map_runs(g, p.device_map)) for p in (plain, plan)]
    assert fast[0] == fast[1]
    # resident bytes count experts where the runtime keeps them: only the experts that gave their room to the cache
    # go back to where their module is mapped
    assert plan.resident("disk") >= plain.resident("disk")
    assert sum(map(plan.resident, ("cpu", "disk", 0))) == sum(map(plain.resident, ("cpu", "disk", 0))) == total
    assert plan.runtime.expert_cache == (4 if plan.experts else 0)


def test_an_expert_cache_that_does_not_fit_or_is_not_a_count_is_a_typed_error(saved):
    folder, ref, meta, budgets = saved
    for bad in (-1, True, 2.0, "4"):
        with pytest.raises(InvalidOption, match="expert_cache must be a non-negative integer"):
            allocator.plan(meta, dict(budgets), runtime="allocator", expert_cache=bad)
    with pytest.raises(InvalidOption, match=r"expert_cache=10000 needs .* pass expert_cache=\d+ or less"):
        allocator.plan(meta, dict(budgets), runtime="allocator", expert_cache=10000)


def test_the_cache_round_trips_in_the_plans_data(saved):
    folder, ref, meta, budgets = saved
    plan = allocator.plan(meta, dict(budgets), runtime="allocator", expert_cache=SLOTS)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["runtime"]["expert_cache"] == SLOTS and data["options"]["expert_cache"] == SLOTS
    assert data["runtime"]["buffers"]["expert_cache"] == plan.runtime.buffers["expert_cache"] > 0
    assert Runtime.from_dict(data["runtime"]) == plan.runtime
    assert allocator.Plan.from_dict(data).runtime == plan.runtime
    again = allocator.Plan.from_dict(data, meta)
    assert again.runtime == plan.runtime and again.peak == plan.peak


@pytest.mark.slow
@pytest.mark.parametrize("device", [None, "stand-in"])
def test_patch_runs_the_cache_plan_and_attach_run(saved, device, tmp_path):
    folder, ref, meta, budgets = saved
    plan = allocator.plan(meta, dict(budgets), runtime="allocator", expert_cache=SLOTS)
    explicit, ours = _loaded(folder, plan, tmp_path / "a", device)
    with hf.patch(runtime="allocator", offload_device=device, expert_cache=SLOTS):
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory=dict(budgets),
                                                     offload_folder=tmp_path / "b",
                                                     experts_implementation="eager").eval()
    theirs = offload.runtime_of(model)
    try:
        assert theirs.plan == ours.plan == plan.runtime and theirs.state == ours.state
        torch.manual_seed(1)
        ids = torch.randint(0, 128, (1, 10))
        expected = ref.generate(ids, max_new_tokens=6, do_sample=False)
        for m in (explicit, model):
            assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False), expected)
        assert theirs.traffic == ours.traffic and ours.traffic.cache_hits > 0
    finally:
        offload.detach(explicit)
        offload.detach(model)


def test_lru_puts_out_the_least_recently_used():
    cache = ExpertCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1                    # "b" is now the least recently used
    assert cache.put("c", 3) == [("b", 2)]
    assert "a" in cache and "c" in cache and cache.get("b") is None
    assert (cache.hits, cache.misses, cache.evicted) == (1, 1, 1)
    assert ExpertCache(0).put("a", 1) == [] and len(ExpertCache(0)) == 0


def _private_bytes(mm) -> int:
    """Bytes of ``mm``'s mapping held as private pages by this process (``Private_Dirty`` in /proc/self/smaps)."""
    import ctypes

    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Private_Dirty:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found in /proc/self/smaps")


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED") or not __import__("os").path.exists(
    "/proc/self/smaps"), reason="needs madvise(MADV_DONTNEED) and /proc/self/smaps (Linux)")
def test_an_evicted_experts_pages_are_given_back(tmp_path):
    """On a CPU main device a cached expert is kept in RAM as private pages of the file's mapping; the one the cache
    puts out is given back (``MADV_DONTNEED``): with one slot, routing experts 0, 1, 2 in turn leaves one expert's
    pages held, not three."""
    import types

    from allocator.offload.expert_cache import in_place
    from allocator.offload.files import PAGE, MappedFile

    experts, per = 8, 64 * PAGE
    path = tmp_path / "experts.dat"
    path.write_bytes(bytes(range(256)) * (experts * per // 256))
    mapped = MappedFile(str(path), raw=True)
    routed = types.SimpleNamespace(
        cache=ExpertCache(1), layer=types.SimpleNamespace(experts="layer", num_experts=experts),
        traffic=types.SimpleNamespace(cache_hits=0, cache_misses=0),
        sources={"w": types.SimpleNamespace(file=mapped, start=0, end=experts * per)})
    assert _private_bytes(mapped.mm) == 0
    held = []
    for e in (0, 1, 2):
        assert in_place(routed, [e]) == [e]
        held.append(_private_bytes(mapped.mm))
    assert all(per <= h < 2 * per for h in held), held   # the kernel may count a little more (large folios)
    assert mapped.kept == [(2 * per, 3 * per)] and routed.cache.evicted == 2
    assert in_place(routed, [2]) == [] and routed.traffic.cache_hits == 1
    assert bytes(mapped.mm[per:2 * per]) == path.read_bytes()[per:2 * per]   # given back: the file's bytes again
