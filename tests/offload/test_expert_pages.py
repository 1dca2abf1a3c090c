"""The MoE runtime on a CPU main device does no per-call work that the model in RAM does not need (issue #48):
routed experts' pages are asked about (``mincore``) before they are read ahead, not re-read-ahead while in memory;
an expert found in memory is not asked about again for :data:`allocator.offload.expert_pages.FRESH` seconds; the host
views of the mapped tensors are made once; the experts hook passes CPU arguments through. The cold path stays: after
``evict`` and the page cache dropped, the routed experts are read ahead again."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

import allocator
from allocator.offload import attach, detach, files
from allocator.offload.expert_pages import FRESH, Residency, runs_of
from allocator.offload.files import PAGE, MappedFile

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from moe_models import small_model  # noqa: E402

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"),
                           reason="mincore and posix_fadvise as Linux has them")


def _drop(path: str) -> None:
    """Drop ``path``'s pages from the page cache (written back first; the kernel may still keep some)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _file(tmp_path, pages: int = 256):
    path = tmp_path / "experts.dat"
    path.write_bytes(os.urandom(pages * PAGE))
    mapped = MappedFile(str(path), raw=True)
    mapped.mm.madvise(mmap.MADV_RANDOM)   # as the runtime maps experts: a fault reads its page, not its neighbours
    return str(path), mapped, torch.frombuffer(mapped.mm, dtype=torch.uint8).data_ptr()


@linux
def test_missing_names_only_the_ranges_with_a_page_not_in_memory(tmp_path):
    path, mapped, address = _file(tmp_path)
    pages = Residency()
    ranges = [(0, 4 * PAGE), (8 * PAGE, 12 * PAGE), (140 * PAGE, 141 * PAGE)]  # two close ranges and a far one
    memoryview(mapped.mm)[::PAGE].tobytes()                                   # every page read: in memory
    assert pages.missing(path, address, ranges) == []
    assert pages.calls == 2                                                   # the close ones in one call
    mapped.mm.madvise(mmap.MADV_DONTNEED)
    _drop(path)
    if pages.missing(path, address, ranges) != ranges:
        pytest.skip("the kernel kept the file's pages in the page cache")
    memoryview(mapped.mm)[8 * PAGE:12 * PAGE:PAGE].tobytes()                  # one range read back in
    assert pages.missing(path, address, ranges) == [(0, 4 * PAGE), (140 * PAGE, 141 * PAGE)]
    mapped.close()


def test_a_file_mincore_cannot_tell_about_is_always_missing(tmp_path, monkeypatch):
    path, mapped, address = _file(tmp_path, pages=4)
    pages = Residency()
    monkeypatch.setattr(pages, "tells", lambda p: False)   # another user's read-only file: Linux answers "resident"
    memoryview(mapped.mm)[::PAGE].tobytes()
    assert pages.missing(path, address, [(0, PAGE)]) == [(0, PAGE)] and pages.calls == 0
    mapped.close()


def test_an_expert_known_in_memory_is_not_asked_about_again_until_forgotten(monkeypatch):
    import allocator.offload.expert_pages as expert_pages

    clock = [100.0]
    monkeypatch.setattr(expert_pages.time, "monotonic", lambda: clock[0])
    pages = Residency()
    assert pages.stale("l0", [1, 2]) == [1, 2]
    assert pages.stale("l0", [1, 2]) == [] and pages.stale("l1", [1]) == [1]   # per layer
    clock[0] += FRESH / 2
    assert pages.stale("l0", [1, 2, 3]) == [3]
    clock[0] += FRESH / 2
    assert pages.stale("l0", [1, 3]) == [1]                  # asked about again FRESH seconds after it was
    pages.forget("l0", 3)
    assert pages.stale("l0", [3]) == [3]
    pages.forget()
    assert pages.stale("l0", [1, 2]) == [1, 2] and pages.stale("l1", [1]) == [1]


def test_runs_of_consecutive_experts():
    assert runs_of([7, 3, 4, 5, 0]) == [(0, 1), (3, 6), (7, 8)] and runs_of([]) == []


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """A tiny Qwen3-MoE saved, in RAM, and loaded under ``patch(runtime="allocator")`` with 40 % of its bytes in RAM
    (the rest mapped from files)."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    small_model("qwen3_moe", layers=4).save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    with allocator.patch(runtime="allocator"):
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": int(0.4 * total)},
                                                     offload_folder=str(folder / "off"),
                                                     experts_implementation="eager").eval()
    return folder, ref, model


def _decode(model, ids, steps: int, on_step=None):
    from transformers import DynamicCache

    out = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        for i in range(steps):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
            if on_step is not None:
                on_step(i)
    return out


def _counting(monkeypatch):
    advised = []
    advise = files.MappedFile.advise
    monkeypatch.setattr(files.MappedFile, "advise", lambda self, a, b: (advised.append((self.path, a, b)),
                                                                         advise(self, a, b)))
    return advised


@linux
def test_warm_decode_reads_nothing_ahead_and_asks_once(offloaded, monkeypatch):
    """Warm decode, tokens equal to the model in RAM: no ``MADV_WILLNEED`` while the routed experts are in memory
    (``mincore`` says so), and no ``mincore`` either for experts found there within FRESH seconds."""
    import allocator.offload.expert_pages as expert_pages
    from allocator.offload import runtime_of

    monkeypatch.setattr(expert_pages, "FRESH", 600.0)               # a slow machine stays within it
    _, ref, model = offloaded
    runtime = runtime_of(model)
    routed = next(iter(runtime.experts.values()))
    assert routed.in_place and routed.pages is not None and len(routed.rows) < routed.layer.num_experts
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    want = _decode(ref, ids, 10)
    assert _decode(model, ids, 10) == want                          # the files' pages in memory
    advised = _counting(monkeypatch)
    routed.pages.forget()
    calls, read = routed.pages.calls, runtime.traffic.read
    assert _decode(model, ids, 10) == want
    assert runtime.traffic.read > read                              # offloaded experts were routed and read
    assert advised == [] and routed.pages.calls > calls             # asked, found in memory, not read ahead
    calls = routed.pages.calls
    assert _decode(model, ids, 10) == want
    assert advised == [] and routed.pages.calls == calls            # known: not even asked


@linux
def test_cold_decode_reads_the_routed_experts_ahead_again(offloaded, monkeypatch):
    """After ``evict`` and the page cache dropped (``benchmarks/moe.py``'s cold decode) the routed experts' slices are
    read ahead again (``MADV_WILLNEED``), and the tokens stay those of the model in RAM."""
    from allocator.offload import runtime_of

    _, ref, model = offloaded
    runtime = runtime_of(model)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    want = _decode(ref, ids, 4)
    assert _decode(model, ids, 4) == want
    advised = _counting(monkeypatch)
    paths = {f.path for f in runtime.files.open.values()}

    def cold(_):
        runtime.evict()
        for path in paths:
            _drop(path)

    cold(0)
    routed = next(iter(runtime.experts.values()))
    if not any(routed.pages.missing(f.path, torch.frombuffer(f.mm, dtype=torch.uint8).data_ptr(), [(0, len(f.mm))])
               for f in runtime.files.open.values() if f.mm is not None and len(f.mm)):
        pytest.skip("the kernel kept the files' pages in the page cache")
    assert _decode(model, ids, 4, on_step=cold) == want
    assert len(advised) >= 4, advised                             # every step read its routed experts ahead


def test_host_views_are_made_once_and_released(offloaded):
    from allocator.offload import runtime_of

    _, _, model = offloaded
    routed = next(iter(runtime_of(model).experts.values()))
    name = next(iter(routed.sources))
    assert routed.host(name) is routed.host(name)
    views = dict(routed.views)
    assert views and all(v is routed.host(n) for n, v in views.items())


def test_the_experts_hook_passes_cpu_arguments_through(offloaded, monkeypatch):
    """On a CPU main device the experts hook hands the module its CPU arguments as they are, without accelerate's
    walk over them (``send_to_device``); arguments it cannot vouch for (keywords) still take that walk."""
    import accelerate.utils

    from allocator.offload import ExpertsHook, runtime_of

    _, _, model = offloaded
    walks = []
    send = accelerate.utils.send_to_device
    monkeypatch.setattr(accelerate.utils, "send_to_device", lambda *a, **k: (walks.append(1), send(*a, **k))[1])
    module = next(m for m in model.modules() if isinstance(m.__dict__.get("_hf_hook"), ExpertsHook))
    hook = module._hf_hook
    assert hook.on_host and runtime_of(model) is not None
    args = (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    out_args, out_kwargs = hook.pre_forward(module, *args)
    assert walks == [] and all(a is b for a, b in zip(out_args, args)) and out_kwargs == {}
    assert hook.post_forward(module, args[0]) is args[0] and walks == []
    hook.pre_forward(module, args[0], top_k_index=args[1], top_k_weights=args[2])
    assert walks                                                   # keywords: accelerate's walk, as before


def test_detach_lets_go_of_the_views(tmp_path):
    folder = tmp_path / "m"
    small_model("qwen3_moe", layers=2).save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    plan = allocator.plan(meta, {"cpu": int(total * 0.4)}, runtime="allocator")
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=plan.device_map, offload_folder=folder / "off",
                                                 experts_implementation="eager").eval()
    runtime = attach(model, plan)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    assert _decode(model, ids, 3) == _decode(ref, ids, 3)
    routed = list(runtime.experts.values())
    assert all(r.views for r in routed)
    detach(model)
    assert all(not r.views and r.whole is None for r in routed)
    assert all(f.mm is None for f in runtime.files.open.values()) and not runtime.files.open
