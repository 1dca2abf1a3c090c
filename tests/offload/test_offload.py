"""The allocator offload runtime (``allocator/offload.py``) against accelerate's hooks and the model in RAM.

Small random models are saved to disk and loaded with 30 % of their size as the RAM budget (CPU main device, the rest
streamed from disk). With our hooks in place of accelerate's, each test checks one promise of the runtime:

- outputs equal the fully-in-RAM model's (within the float tolerance of ``models.TOLERANCE``), for llama, T5, ViT
  and Segformer loaded by transformers' ``from_pretrained``, and for llama and T5 by accelerate's
  ``load_checkpoint_and_dispatch`` (:func:`dispatch`; ViT and Segformer checkpoints are not loaded there: their plans
  are for ``from_pretrained``), at prefetch 0, 1, 2;
- greedy ``generate`` gives the same 20 new tokens as in RAM (llama, T5: repeated forwards, KV cache);
- offloaded buffers, tied weights, :func:`detach` (accelerate's hooks back, same outputs), typed errors;
- an error on the prefetch thread reaches the forward that needed the weights;
- on the stream device (with the CPU stand-in for a GPU) the compute stream waits only after the copy was recorded,
  and with prefetch the next unit's copy is issued before the running unit ends;
- the offloaded weights held at once, measured from outside the runtime (each staged tensor followed until it is
  freed), stay within what the plan reserves for the runtime and its prefetch.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate_hooks = pytest.importorskip("accelerate.hooks")

import allocator  # noqa: E402
from allocator import offload  # noqa: E402
from allocator.errors import InvalidOption, InvalidRuntime  # noqa: E402
from models import DTYPE, SavedModel, assert_same_output, tiny_specs  # noqa: E402

SHARE = 0.3
MODELS = ("llama", "t5", "vit", "segformer")


@pytest.fixture(scope="module")
def cases(tmp_path_factory, quiet):
    root = tmp_path_factory.mktemp("offload_models")
    specs = tiny_specs()
    out = {name: SavedModel(name, *specs[name], root, budget_share=SHARE) for name in (*MODELS, "gpt2")}
    out["segformer_buffers"] = SavedModel("segformer_buffers", *specs["segformer"], root, budget_share=SHARE,
                                          perturb_buffers=True)
    return out


def _plan(case, **options):
    return allocator.plan(case.meta, dict(case.max_memory), **options)


def _loaded(case, tmp_path, **options):
    p = _plan(case, **options)
    assert "disk" in p.device_map.values(), p.device_map
    return p, case.load(p.device_map, tmp_path / "offload")


class Held:
    """A device wrapper that follows every tensor the runtime stages until it is freed: bytes held at once."""

    def __init__(self, inner):
        self.inner, self.current, self.max = inner, 0, 0
        self.threaded = inner.threaded
        self.advise = inner.advise

    def stage(self, slots, *, ahead):
        handle = self.inner.stage(slots, ahead=ahead)
        for t in (handle[0] if isinstance(handle, tuple) else handle).values():
            self.current += t.nbytes
            self.max = max(self.max, self.current)
            weakref.finalize(t, self._free, t.nbytes)
        return handle

    def _free(self, nbytes):
        self.current -= nbytes

    def ready(self, handle):
        return self.inner.ready(handle)


@pytest.mark.parametrize("name", MODELS)
def test_outputs_equal_in_ram_model_from_pretrained(cases, name, tmp_path):
    case = cases[name]
    p, model = _loaded(case, tmp_path)
    for k in (0, 1, 2):
        runtime = offload.attach(model, p, prefetch=k)
        assert runtime.units
        assert all(isinstance(u.module._hf_hook, offload.OffloadHook) for u in runtime.units)
        for _ in range(2):   # the second forward runs with what the scheduler learnt in the first
            assert_same_output(case.logits(model), case.reference, msg=str((name, k)))
        offload.detach(model)


def test_outputs_equal_in_ram_model_load_checkpoint_and_dispatch(cases, tmp_path):
    from accelerate import init_empty_weights

    case = cases["llama"]
    p = _plan(case, loader="accelerate")
    assert "disk" in p.device_map.values()
    with init_empty_weights():
        model = case.cls(case.config)
    model = offload.dispatch(model, p, case.path, offload_folder=str(tmp_path / "offload"), dtype=DTYPE,
                             prefetch=1)
    runtime = model._allocator_runtime
    assert runtime.units and any(s.source.file is not None for u in runtime.units for s in u.slots)
    mapped = dict(runtime.files.open)
    for _ in range(2):
        assert_same_output(case.logits(model), case.reference)
    assert runtime.files.open == mapped    # each .dat file mapped once, at attach, reused by every forward
    assert {id(s.source.file) for u in runtime.units for s in u.slots} == {id(f) for f in mapped.values()}


def test_t5_tied_embeddings_refused_where_accelerate_fails_too(cases, tmp_path):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    case = cases["t5"]
    p = _plan(case, loader="accelerate")
    with init_empty_weights():
        model = case.cls(case.config)
    model = load_checkpoint_and_dispatch(model, case.path, device_map=p.device_map, dtype=DTYPE,
                                         offload_folder=str(tmp_path / "offload"))
    with pytest.raises(KeyError, match="encoder.embed_tokens.weight"):   # accelerate's hooks
        case.logits(model)
    with pytest.raises(InvalidRuntime, match="from_pretrained"):
        offload.attach(model, p)


@pytest.mark.parametrize("name", ("llama", "t5"))
def test_generate_gives_the_in_ram_tokens(cases, name, tmp_path):
    case = cases[name]
    ram = case.cls.from_pretrained(case.path, dtype=DTYPE).eval()
    prompt = {k: v for k, v in case.inputs.items() if k == "input_ids"}
    settings = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None,
                    decoder_start_token_id=0)
    with torch.no_grad():
        expected = ram.generate(**prompt, **settings)
    p, model = _loaded(case, tmp_path)
    offload.attach(model, p, prefetch=1)
    with torch.no_grad():
        got = model.generate(**prompt, **settings)
    assert got.shape[-1] >= 20
    assert torch.equal(got, expected)


def test_offloaded_buffers_are_streamed_and_read_from_the_checkpoint(cases, tmp_path):
    case = cases["segformer_buffers"]   # saved BatchNorm statistics differ from __init__'s
    device_map = dict(_plan(case, offload_buffers=True).device_map, **{"decode_head.batch_norm": "disk"})
    model = case.cls.from_pretrained(case.path, dtype=DTYPE, device_map=device_map, offload_buffers=True,
                                     offload_folder=str(tmp_path / "offload"))
    assert_same_output(case.logits(model), case.reference)      # accelerate's hooks
    runtime = offload.attach(model, device_map, prefetch=1)
    buffers = [s for u in runtime.units for s in u.slots if not s.is_param]
    assert buffers, "offload_buffers=True: the runtime streams buffers too"
    for _ in range(2):
        assert_same_output(case.logits(model), case.reference)
    assert all(s.owner._buffers[s.attr].device.type == "meta" for s in buffers)   # back to meta after each forward


def test_tied_weights_fetched_once_and_shared(cases, tmp_path):
    case = cases["gpt2"]   # lm_head.weight is transformer.wte.weight; both modules are on disk at 30 %
    p, model = _loaded(case, tmp_path)
    runtime = offload.attach(model, p, prefetch=0)
    assert_same_output(case.logits(model), case.reference)
    wte, head = (next(u for u in runtime.units if u.name == n) for n in ("transformer.wte", "lm_head"))
    assert wte.slots[0].source.key == head.slots[0].source.key   # one tensor of the checkpoint behind both
    # Both modules holding it at once (as nested hooks would) materialise it once, and it stays until the last
    # of them is done.
    runtime.load(wte)
    runtime.load(head)
    assert runtime.held == wte.nbytes
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    runtime.drop(wte)
    assert runtime.held == wte.nbytes and model.lm_head.weight.device.type != "meta"
    assert model.transformer.wte.weight.device.type == "meta"
    runtime.drop(head)
    assert runtime.held == 0 and not runtime.live and model.lm_head.weight.device.type == "meta"
    assert_same_output(case.logits(model), case.reference)


def test_detach_puts_accelerates_hooks_back(cases, tmp_path):
    case = cases["llama"]
    p, model = _loaded(case, tmp_path)
    before = {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    offload.attach(model, p)
    with pytest.raises(InvalidRuntime, match="detach"):
        offload.attach(model, p)
    assert_same_output(case.logits(model), case.reference)
    offload.detach(model)
    after = {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    assert after == before and offload.has_offload_hooks(model)
    assert not any(isinstance(h, offload.OffloadHook) for h in after.values())
    assert_same_output(case.logits(model), case.reference)
    with pytest.raises(InvalidRuntime, match="attach"):
        offload.detach(model)


def test_attach_refuses_what_it_cannot_run(cases, tmp_path):
    case = cases["llama"]
    in_ram = case.cls.from_pretrained(case.path, dtype=DTYPE)
    with pytest.raises(InvalidRuntime, match="no offloaded modules"):
        offload.attach(in_ram)
    p, model = _loaded(case, tmp_path)
    other = dict(p.device_map, lm_head="cpu")
    with pytest.raises(InvalidRuntime, match="not the plan's"):
        offload.attach(model, other)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidOption, match="prefetch"):
            offload.attach(model, p, prefetch=bad)
    assert not hasattr(model, "_allocator_runtime")


class Failing(offload.HostDevice):
    """Fails staging the unit named ``bad`` on the prefetch thread."""

    def __init__(self, bad):
        super().__init__(thread=True)
        self.bad = bad

    def stage(self, slots, *, ahead):
        if ahead and any(s.source.key == self.bad for s in slots):
            raise RuntimeError("disk read failed")
        return super().stage(slots, ahead=ahead)


def test_prefetch_thread_error_reaches_the_forward(cases, tmp_path):
    case = cases["llama"]
    p, model = _loaded(case, tmp_path)
    probe = offload.attach(model, p, prefetch=0)
    second = probe.units[1].slots[0].source.key
    offload.detach(model)
    # Deterministic: the forward that needs unit 1 waits on its future, which holds the thread's exception.
    runtime = offload.attach(model, p, prefetch=1, device=Failing(second))
    with pytest.raises(RuntimeError, match="disk read failed"):
        case.logits(model)
    offload.detach(model)
    assert runtime.executor._shutdown


@pytest.mark.parametrize("k", (0, 1))
def test_stream_device_waits_only_for_recorded_copies(cases, tmp_path, k):
    case = cases["llama"]
    p, model = _loaded(case, tmp_path)
    device = offload.StandInDevice()
    runtime = offload.attach(model, p, prefetch=k, device=device)
    started = []
    handles = [u.module.register_forward_pre_hook(lambda m, a, n=u.name: started.append(n)) for u in runtime.units]
    name = {u.slots[0].source.key: u.name for u in runtime.units}
    assert_same_output(case.logits(model), case.reference)
    for future in runtime.pending.values():   # the prefetch thread may still be issuing the next forward's copy
        future.result()
    first = len(device.log)
    del started[:]
    assert_same_output(case.logits(model), case.reference)   # the second forward: the order is learnt
    for future in runtime.pending.values():
        future.result()
    for h in handles:
        h.remove()
    log = [(kind, stream, name[key]) for kind, stream, key in device.log]
    assert all(s == "side" for kind, s, _ in log if kind == "record")
    assert all(s == "compute" for kind, s, _ in log if kind == "wait")
    now = log[first:]
    waits = [i for i, e in enumerate(now) if e[0] == "wait"]
    assert [now[i][2] for i in waits] == started and len(started) == len(runtime.units)   # each unit waited once
    if k == 0:   # inline: each copy recorded just before its wait
        assert [e[0] for e in now] == ["record", "wait"] * len(started)
        return
    # ahead: every unit's copy is recorded after the wait of the unit before it, before its own wait: the compute
    # stream never waits for a copy issued late; the first unit of this forward was issued by the last forward.
    records = [i for i, e in enumerate(now) if e[0] == "record"]
    assert len(records) == len(started)       # no wrong guess, no inline fetch
    assert log[first - 1] == ("record", "side", started[0])
    for (a, b), r in zip(zip(waits, waits[1:]), records):
        assert a < r < b and now[r][2] == now[b][2]
    assert now[records[-1]][2] == started[0]   # the next forward's first unit is already on its way


@pytest.mark.parametrize("name", MODELS)
def test_weights_held_at_once_fit_the_plans_reserve(cases, name, tmp_path):
    case = cases[name]
    for k, thread in ((0, False), (1, False), (1, True), (2, True)):
        p, model = _loaded(case, tmp_path / f"{k}{thread}", runtime="allocator", prefetch=k)
        meter = Held(offload.HostDevice(thread=thread))
        runtime = offload.attach(model, p, device=meter)
        assert runtime.prefetch == k    # from the plan's options
        for _ in range(2):
            assert_same_output(case.logits(model), case.reference)
        offload.detach(model)
        gc.collect()
        reserve = p.streamed + p.prefetch
        assert 0 < meter.max <= reserve, (name, k, meter.max, reserve)
        if not thread:   # read-ahead only: nothing held beyond the running chain
            assert meter.max <= p.streamed
        assert runtime.peak_held <= reserve
        assert meter.current == 0 and runtime.held == 0


# -- the plan reserves what the runtime holds ---------------------------------------------------------------------

def test_plan_options_runtime_and_prefetch_are_checked(cases):
    meta = cases["llama"].meta
    with pytest.raises(InvalidOption, match="runtime must be one of"):
        allocator.plan(meta, {"cpu": 10**6}, runtime="fast")
    for bad in (-1, 0.5, False):
        with pytest.raises(InvalidOption, match="prefetch must be a non-negative integer"):
            allocator.plan(meta, {"cpu": 10**6}, runtime="allocator", prefetch=bad)


@pytest.mark.parametrize("name", MODELS)
def test_prefetch_reserve_in_every_strategys_plan(cases, name):
    from allocator.evaluate.validate import check

    case = cases[name]
    budgets = {"cpu": int(0.7 * case.total)}
    base = _plan(case)
    assert base.prefetch == 0
    assert _plan(case, runtime="allocator", prefetch=0).device_map == base.device_map   # prefetch 0: accelerate's
    ahead = {}
    for k in (1, 2):
        for strategy in ("auto", "sequential", "backfill", "reserve", "ilp", "balanced"):
            p = allocator.plan(case.meta, dict(budgets), strategy=strategy, runtime="allocator", prefetch=k)
            violations, memory = check(p.problem, p.device_map)
            assert memory.prefetch == p.prefetch and p.peak["cpu"] >= p.resident("cpu") + p.streamed + p.prefetch
            if strategy != "sequential":   # sequential is accelerate's map, not made for a runtime
                assert p.valid and not violations, (name, strategy, k, p.explain())
            if p.streamed:
                assert 0 < p.prefetch <= k * p.streamed   # each module made ready ahead streams at most a chain
        ahead[k] = p.prefetch
        if p.prefetch:
            assert "prefetch" in p.explain()
    plain = allocator.plan(case.meta, dict(budgets), strategy="auto")
    assert plain.streamed, "70 % of the model's size as RAM streams something: the checks below would not run"
    assert ahead[2] >= ahead[1] > 0
    # the same map costs more on the main device under the prefetching runtime
    same = check(allocator.build_problem(case.meta, dict(budgets), runtime="allocator", prefetch=1),
                 plain.device_map)[1]
    assert same.peak["cpu"] == plain.peak["cpu"] + same.prefetch > plain.peak["cpu"]


def test_prefetch_reserve_is_the_largest_modules_whatever_the_order():
    from allocator.evaluate.memory import map_runs, offloaded_devices, prefetch_reserve

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 64), torch.nn.Linear(64, 4),
                                torch.nn.Linear(4, 32))
    g = allocator.build_problem(model, {"cpu": 10**6}).graph
    runs = map_runs(g, {"": "disk"})
    sizes = sorted((sum(p.nbytes for p in m.parameters()) for m in model), reverse=True)
    off = offloaded_devices("cpu")
    assert prefetch_reserve(g, runs, off, 0) == 0
    assert prefetch_reserve(g, runs, off, 1) == sizes[0]
    assert prefetch_reserve(g, runs, off, 2) == sizes[0] + sizes[1]   # not adjacent in module order
    assert prefetch_reserve(g, runs, off, 9) == sum(sizes)
    assert prefetch_reserve(g, map_runs(g, {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk"}), off, 1) == sizes[1]


# -- patch(runtime="allocator") and dispatch() ----------------------------------------------------------------------

def test_patch_runtime_allocator_runs_our_hooks_after_from_pretrained(cases, tmp_path):
    from allocator.integrations import transformers as hf

    case = cases["llama"]
    budgets = {"cpu": int(0.7 * case.total)}
    expected = allocator.plan(case.meta, dict(budgets), runtime="allocator", prefetch=1)
    assert expected.valid and expected.prefetch and "disk" in expected.device_map.values()
    with hf.patch(runtime="allocator", prefetch=1):
        model = case.cls.from_pretrained(case.path, dtype=DTYPE, device_map="auto", max_memory=dict(budgets),
                                         offload_folder=str(tmp_path / "offload"))
    assert model.hf_device_map == expected.device_map
    runtime = model._allocator_runtime
    assert runtime.prefetch == 1 and all(isinstance(u.module._hf_hook, offload.OffloadHook) for u in runtime.units)
    for _ in range(2):
        assert_same_output(case.logits(model), case.reference)
    assert runtime.peak_held <= expected.streamed + expected.prefetch
    # without runtime="allocator" the patch leaves accelerate's hooks alone
    with hf.patch():
        plain = case.cls.from_pretrained(case.path, dtype=DTYPE, device_map="auto", max_memory=dict(budgets),
                                         offload_folder=str(tmp_path / "offload2"))
    assert not hasattr(plain, "_allocator_runtime") and offload.has_offload_hooks(plain)


def test_host_read_ahead_asks_the_kernel_for_the_next_module(cases, tmp_path):
    case = cases["llama"]
    p, model = _loaded(case, tmp_path)
    device = offload.HostDevice()
    events = []
    device.advise = lambda slots: events.append(("advise", slots[0].source.key))
    runtime = offload.attach(model, p, prefetch=1, device=device)
    assert runtime.executor is None            # no thread: the kernel reads ahead
    key = {u.name: u.slots[0].source.key for u in runtime.units}
    handles = [u.module.register_forward_pre_hook(lambda m, a, n=u.name: events.append(("run", key[n])))
               for u in runtime.units]
    assert_same_output(case.logits(model), case.reference)
    del events[:]
    assert_same_output(case.logits(model), case.reference)   # learnt order
    for h in handles:
        h.remove()
    runs = [k for kind, k in events if kind == "run"]
    assert len(runs) == len(runtime.units)
    # after each module starts, the one that runs next is advised, before it runs
    for a, b in zip(runs, runs[1:]):
        i, j = events.index(("run", a)), events.index(("run", b))
        assert ("advise", b) in events[i:j]
    assert runtime.held == 0 and runtime.peak_held <= p.streamed


@pytest.mark.parametrize("name", ("llama", "t5", "segformer"))
def test_every_strategy_keeps_the_prefetch_reserve_with_accelerators(cases, name):
    """Two GPUs and RAM: every strategy's plan for the allocator runtime validates with its prefetch counted."""
    from allocator.evaluate.validate import check

    case = cases[name]
    rng = random.Random(name)
    streaming = 0
    for _ in range(3):
        budgets = {0: int(rng.uniform(0.1, 0.6) * case.total), 1: int(rng.uniform(0.1, 0.6) * case.total),
                   "cpu": int(rng.uniform(0.1, 1.0) * case.total)}
        for strategy in ("auto", "backfill", "reserve", "ilp", "balanced", "balanced_low_0"):
            try:
                p = allocator.plan(case.meta, dict(budgets), strategy=strategy, runtime="allocator", prefetch=1,
                                   strict=True)
            except allocator.InfeasiblePlacement:
                continue
            violations, memory = check(p.problem, p.device_map)
            assert not violations and p.valid, (budgets, strategy, p.explain())
            main = p.main_device
            assert p.peak[main] <= budgets[main]
            if p.streamed:
                assert memory.prefetch > 0
                streaming += 1
    assert streaming, "no plan offloaded anything: the test would not see the prefetch reserve"


@pytest.mark.parametrize("device", [None, "stand-in"])
def test_weights_offloaded_to_ram_by_accelerates_cpu_offload(device):
    """``accelerate.cpu_offload`` keeps weights in a plain state dict (RAM sources, not files), as ``dispatch_model``
    does for ``cpu`` modules under a GPU main device: the runtime streams them the same way."""
    from accelerate import cpu_offload

    cls, config, make_inputs = tiny_specs()["llama"]
    torch.manual_seed(0)
    model = cls(config).eval()
    inputs = make_inputs(torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(**inputs).logits
    cpu_offload(model, execution_device="cpu")
    runtime = offload.attach(model, prefetch=1, device=device)
    assert runtime.units and all(s.source.file is None and s.source.ram is not None
                                 for u in runtime.units for s in u.slots)
    with torch.no_grad():
        for _ in range(2):
            assert_same_output(model(**inputs).logits, expected)
    offload.detach(model)
    assert not runtime.live and runtime.held == 0


def test_attach_warns_when_it_would_hold_more_than_the_plan_reserved(cases, tmp_path):
    import warnings

    case = cases["llama"]
    p, model = _loaded(case, tmp_path)          # a plan for accelerate's hooks: nothing reserved for prefetch
    with pytest.warns(UserWarning, match="beyond what the plan reserved"):
        offload.attach(model, p, prefetch=1, device="stand-in")
    offload.detach(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload.attach(model, p, prefetch=1)    # the CPU's read-ahead holds nothing early
        offload.detach(model)
        offload.attach(model, p)                # the plan's prefetch: 0
    assert model._allocator_runtime.prefetch == 0


def test_prefetch_thread_copies_on_one_intra_op_thread_and_leaves_the_callers_count(cases, tmp_path):
    """The prefetch thread stages on one intra-op thread (docs/runtime.md, "Threads"); the caller's count, and the
    default of threads started later, stay what they were."""
    import threading

    case = cases["llama"]
    p, model = _loaded(case, tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runtime = offload.attach(model, p, prefetch=1, device="stand-in")
        assert runtime.executor.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2]
        assert_same_output(case.logits(model), case.reference)
        offload.detach(model)
    finally:
        torch.set_num_threads(before)
