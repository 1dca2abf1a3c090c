"""Mixtures of experts offloaded: transformers' own load, our runtime without and with expert awareness (issue #33).

Models: transformers' Qwen3-MoE, Mixtral, OLMoE and gpt-oss classes from configs with the real numbers of experts
and top-k (Qwen3-MoE 64 experts top-4 — the issue's shape —, Mixtral 8 top-2, OLMoE 64 top-8, gpt-oss 32 top-4) and
hidden sizes and layers scaled down to run here; float32, random weights (seeded), saved once with
``save_pretrained``. The CPU is the main device with 30 % of the model's bytes as RAM budget, the rest on disk. Rows:

- ``ram``: the model fully in RAM (``experts_implementation="eager"``): the reference for every output;
- ``transformers``: ``from_pretrained(device_map="auto", max_memory=...)`` unpatched (accelerate's hooks);
- ``ours-whole``: ``allocator.plan`` of the same budget (made for accelerate's hooks) run by ``allocator.offload``
  without expert awareness (``attach(experts=False)``: offloaded modules streamed whole);
- ``ours-experts``: ``plan(runtime="allocator")`` (experts as units: all that runs for every token in RAM, experts
  modules on disk, the RAM left holding experts, uniform use) and ``attach``: only the routed experts are read;
- ``ours-profiled``: the same with ``expert_profile=allocator.profile_experts(ram model, [the prompt and the greedy
  tokens of the reference])``;
- ``ours-patch``: the path users take, ``with allocator.patch(runtime="allocator"): from_pretrained(device_map="auto",
  max_memory=...)``: the plan is made inside ``from_pretrained`` and the runtime attached with it
  (``allocator.offload.runtime_of(model)`` returns it); ``ours-patch-profiled`` the same with ``expert_profile=``.

On the Qwen3 shape a copy with *skewed routing* (``<shape>-skewed``: in every layer the router's rows of 8 seeded
"hot" experts scaled by 3, the others by 0.3, so the hot experts win most top-k choices) runs decode through
``patch(runtime="allocator")`` without (``ours-patch``) and with the expert cache (``ours-patch-cache``,
``expert_cache=`` 2 x layers x top-k slots, or the most that fit): ``hit_rate`` is ``Traffic.cache_hits`` over the
offloaded experts looked up; ``-profiled`` the same with ``expert_profile=`` of that model on the prompt and its greedy
tokens (the hot experts resident), ``read_kib_per_token`` the bytes of non-resident expert slices read per decode token
(``Traffic.read``; exact, counted by the runtime, over the decode steps after the prompt's), ``cache_slots`` the plan's
``Runtime.expert_cache``; then the cold decode as above (the cache's pages are kept, as resident experts' are).

``vs_transformers`` is the ``transformers`` row's warm decode time over the row's, measured in the same run;
``resident_experts`` the experts the attached runtime keeps resident and ``resident_share`` the share of the routed
experts it ran that were resident (``Traffic.resident / Traffic.routed`` over the row's forwards).

All loaded with ``experts_implementation="eager"`` (the runtime's experts implementation replaces it where it
attaches). Measured per row, one thread for torch, ``torch.no_grad``: prefill of a ``--prompt``-token prompt (median
of 3), a greedy decode of ``--tokens`` tokens as a loop of forwards with a KV cache (warm: the page cache keeps the
files; ms per token, median), the same decode *cold* (before every step, outside the timing: our mappings' pages
dropped, then ``posix_fadvise(DONTNEED)`` on every file of the checkpoint and offload folder) with the bytes the
process read from the block device per token (``/proc/self/io`` ``read_bytes``), and whether every greedy token
equals the reference's. ``--standin`` adds the accelerator path through :class:`allocator.offload.StandInDevice` on
the Qwen3 shape: bytes copied to the "device" per decode token, against the bytes of the routed experts that are not
resident (counted from the routers' choices by forward hooks), fetched and computed-on-CPU.

    python benchmarks/moe.py                 # four shapes, warm and cold
    python benchmarks/moe.py --smoke         # one tiny shape, a few tokens (CI smoke)
    python benchmarks/moe.py --models qwen3-moe --interleaved 9   # RAM / transformers / patch() timed in rounds
    python benchmarks/moe.py --models qwen3-moe --interleaved 3 --contention 1   # the same beside a busy core

``--interleaved`` also times, per row, the load and the first two ``generate`` calls after it (``load_s``,
``generate_1_s``, ``generate_2_s``: the first ``generate`` after a load is where a cold runtime would show).
``--contention N`` starts N busy processes (a Python spin loop each, pinned to core ``i`` modulo the cores) for the
duration of the rows (``benchutil.Contention``), and then runs torch on its default threads (one per core) unless
``--threads`` says otherwise; the header names both.

Writes ``results/moe.csv`` and ``results/moe.md`` (``--out`` for another folder).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import allocator
from allocator.model.cache_kwarg import cache_keyword
from allocator import offload
from allocator.evaluate.experts import cache_hit_rate
from allocator.model.experts import find_experts

sys.path.insert(0, str(Path(__file__).parent))
from benchutil import Contention, add_contention_arguments, cores, quiet, write_csv  # noqa: E402

OUT = Path(__file__).parent / "results"

SHAPES = {   # real numbers of experts and top-k; widths and depths scaled down
    "qwen3-moe": ("qwen3_moe", dict(hidden_size=256, moe_intermediate_size=64, intermediate_size=512,
                                    num_experts=64, num_experts_per_tok=4, num_hidden_layers=12,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("mixtral", dict(hidden_size=256, intermediate_size=448, num_local_experts=8, num_experts_per_tok=2,
                                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    "olmoe": ("olmoe", dict(hidden_size=256, intermediate_size=64, num_experts=64, num_experts_per_tok=8,
                            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4)),
    "gpt-oss": ("gpt_oss", dict(hidden_size=256, intermediate_size=128, num_local_experts=32, num_experts_per_tok=4,
                                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                layer_types=["full_attention"] * 8)),
}
SMOKE = {"qwen3-moe": ("qwen3_moe", dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=96,
                                         num_experts=16, num_experts_per_tok=4, num_hidden_layers=8,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         decoder_sparse_step=1, mlp_only_layers=[]))}
VOCAB = 512


def build_config(family: str, fields: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, vocab_size=VOCAB, max_position_embeddings=512, **fields)


def build(family: str, fields: dict):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(family, fields)).eval()


def _files(*folders) -> list[str]:
    return [str(p) for folder in folders for p in Path(folder).rglob("*") if p.is_file()]


def _drop(files, runtime) -> None:
    if runtime is not None:
        runtime.evict()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def decode(model, prompt, tokens: int, *, cold: bool = False, files=(), runtime=None, on_step=None):
    """Greedy tokens, seconds per step and bytes read from the block device per step (cold: caches dropped before
    each step); ``on_step(i)``, when given, is called after step ``i`` (0 is the prompt's)."""
    from transformers import DynamicCache

    out, times, reads = [], [], []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids = prompt
        for _ in range(tokens):
            if cold:
                _drop(files, runtime)
            r0, t0 = _read_bytes(), time.perf_counter()
            logits = model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
            reads.append(_read_bytes() - r0)
            out.append(int(nxt))
            ids = nxt
            if on_step is not None:
                on_step(len(out) - 1)
    return out, times, reads


def prefill(model, prompt, repeats: int = 3) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=prompt, use_cache=False)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _load(folder, device_map=None, offload_folder=None, **kw):
    from transformers import AutoModelForCausalLM

    extra = {} if device_map is None else {"device_map": device_map, "offload_folder": str(offload_folder)}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager",
                                                **extra, **kw).eval()


def _saved(name: str, family: str, fields: dict, args, work: Path):
    """The shape saved in ``work / name`` and loaded in RAM, on the meta device, its bytes, the RAM budget
    (``--ram`` of them) and the seeded prompt."""
    from transformers import AutoModelForCausalLM

    folder = work / name
    build(family, fields).save_pretrained(folder)
    ref = _load(folder)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    budget = {"cpu": int(args.ram * total)}
    prompt = torch.randint(0, VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    return folder, ref, meta, total, budget, prompt


def measure(name: str, family: str, fields: dict, args, work: Path) -> list[dict]:
    folder, ref, meta, total, budget, prompt = _saved(name, family, fields, args, work)
    want, ram_times, _ = decode(ref, prompt, args.tokens)
    profile = allocator.profile_experts(ref, [torch.cat([prompt, torch.tensor([want])], dim=1)])
    rows = [_row(name, "ram", total, budget, prefill(ref, prompt), ram_times, [], [], want, want, None)]
    configs = {
        "transformers": lambda off: (_load(folder, "auto", off, max_memory=budget), None),
        "ours-whole": lambda off: _attached(folder, off, allocator.plan(meta, budget), experts=False),
        "ours-experts": lambda off: _attached(folder, off, allocator.plan(meta, budget, runtime="allocator")),
        "ours-profiled": lambda off: _attached(folder, off, allocator.plan(meta, budget, runtime="allocator",
                                                                            expert_profile=profile)),
        "ours-patch": lambda off: _patched(folder, off, budget),
        "ours-patch-profiled": lambda off: _patched(folder, off, budget, expert_profile=profile),
    }
    for row, make in configs.items():
        with tempfile.TemporaryDirectory(dir=work) as off:
            model, runtime = make(off)
            files = _files(folder, off)
            p = prefill(model, prompt)
            got, warm, _ = decode(model, prompt, args.tokens)
            _, cold, reads = decode(model, prompt, args.tokens, cold=True, files=files, runtime=runtime)
            rows.append(_row(name, row, total, budget, p, warm, cold, reads, got, want, runtime))
            if runtime is not None:
                offload.detach(model)
            del model
    theirs = next(r["decode_ms"] for r in rows if r["row"] == "transformers")
    for r in rows:
        r["vs_transformers"] = round(theirs / r["decode_ms"], 2) if r["decode_ms"] else ""
    if args.standin and name.startswith("qwen3"):
        rows += standin(name, folder, meta, budget, prompt, args, work)
    if name.startswith("qwen3"):
        rows += cached(name, family, fields, budget, prompt, args, work)
    return rows


def cache_rows(name: str, family: str, fields: dict, args, work: Path) -> list[dict]:
    """Only the skewed-routing rows (:func:`cached`) of ``name``, under the budget :func:`measure` gives it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(build_config(family, fields))
    total = allocator.build_problem(meta, {"cpu": 0}).graph.total
    prompt = torch.randint(0, VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    return cached(name, family, fields, {"cpu": int(args.ram * total)}, prompt, args, work)


def skewed(model, hot: int = 8, seed: int = 3):
    """``model`` with every router biased to ``hot`` seeded experts (their rows scaled by 3, the others by 0.3)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in find_experts(model):
            gate = model.get_submodule(layer.router).weight
            chosen = torch.randperm(layer.num_experts, generator=generator)[:hot]
            scale = torch.full((layer.num_experts, 1), 0.3)
            scale[chosen] = 3.0
            gate.mul_(scale)
    return model


def _decode_counted(model, prompt, tokens: int, traffic):
    """Greedy tokens, seconds per decode step, and ``(bytes read, cache hits, misses)`` over the decode steps after
    the prompt's (the prompt's step fills the cache and is not counted)."""
    def counters():
        return traffic.read, traffic.cache_hits, traffic.cache_misses

    marks = []
    out, times, _ = decode(model, prompt, tokens, on_step=lambda step: marks.append(counters()) if step == 0 else None)
    return out, times[1:], tuple(a - b for a, b in zip(counters(), marks[0]))


def cached(name, family, fields, budget, prompt, args, work) -> list[dict]:
    """Decode with skewed routing through ``patch(runtime="allocator")``, without and with the expert cache: hit
    rate and bytes of non-resident experts read per token (``Traffic``)."""
    from transformers import AutoModelForCausalLM

    from allocator.errors import InvalidOption

    name, folder = f"{name}-skewed", work / f"{name}-skewed"
    skewed(build(family, fields)).save_pretrained(folder)
    ref = _load(folder)
    want, _, _ = decode(ref, prompt, args.tokens)
    profile = allocator.profile_experts(ref, [torch.cat([prompt, torch.tensor([want])], dim=1)])
    layers = find_experts(ref)
    slots = 2 * len(layers) * (layers[0].top_k or 1)
    total = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(ref.config)
    rows = []
    for row in ("ours-patch", "ours-patch-cache", "ours-patch-profiled", "ours-patch-profiled-cache"):
        keywords = {"expert_profile": profile} if "profiled" in row else {}
        with tempfile.TemporaryDirectory(dir=work) as off:
            while True:
                try:
                    model, runtime = _patched(folder, off, budget, **keywords, **({"expert_cache": slots} if
                                                                                  row.endswith("cache") else {}))
                    break
                except InvalidOption:   # fewer slots fit in the room the every-token parts leave
                    slots //= 2
            got, warm, counts = _decode_counted(model, prompt, args.tokens, runtime.traffic)
            read, hits, misses = counts
            _, cold, reads = decode(model, prompt, args.tokens, cold=True, files=_files(folder, off), runtime=runtime)
            r = _row(name, row, total, budget, 0.0, warm, cold, reads, got, want, runtime)
            r.update(prefill_ms="", cache_slots=runtime.plan.expert_cache if runtime.plan else 0,
                     hit_rate=round(hits / (hits + misses), 3) if hits + misses else "",
                     hit_rate_estimate=_estimated_hit_rate(meta, budget, keywords, runtime, profile),
                     read_kib_per_token=round(read / len(warm) / 1024, 1))
            rows.append(r)
            offload.detach(model)
            del model
    return rows


def _estimated_hit_rate(meta, budget, keywords, runtime, routing):
    """The cost model's *estimate* of the cache's hit rate for the plan the runtime runs
    (:func:`allocator.evaluate.experts.cache_hit_rate`: Che's approximation for LRU), from the routing the row really
    sees (``routing``: the profile of the skewed model on the prompt and its greedy tokens), one token per step;
    ``""`` without a cache. The plan is made again on the meta device with the row's options (the one ``patch()``
    made: the runtime's experts are checked equal to it)."""
    slots = runtime.plan.expert_cache if runtime.plan else 0
    if not slots:
        return ""
    ours = allocator.plan(meta, budget, runtime="allocator", expert_cache=slots, **keywords)
    assert {k: tuple(v) for k, v in ours.experts.items()} == {k: tuple(v) for k, v in runtime.plan.experts.items()}
    problem = allocator.build_problem(meta, budget, runtime="allocator", expert_cache=slots, expert_profile=routing,
                                      profile=allocator.Profile(tokens=1))
    rate = cache_hit_rate(problem, ours.placement)
    return round(rate, 3) if rate is not None else ""


def _patched(folder, off, budget, **keywords):
    """The path users take: ``patch(runtime="allocator")`` around ``from_pretrained(device_map="auto")``."""
    with allocator.patch(runtime="allocator", **keywords):
        model = _load(folder, "auto", off, max_memory=budget)
    return model, offload.runtime_of(model)


def _attached(folder, off, plan, experts=None):
    model = _load(folder, plan.device_map, off)
    return model, offload.attach(model, plan, experts=experts)


def _row(model, row, total, budget, prefill_s, warm, cold, reads, got, want, runtime) -> dict:
    resident = share = ""
    if runtime is not None and runtime.experts:
        resident = sum(len(r.rows) for r in runtime.experts.values())
        share = round(runtime.traffic.resident / runtime.traffic.routed, 3) if runtime.traffic.routed else 0.0
    return dict(model=model, row=row, model_mib=round(total / 2 ** 20, 1),
                ram_budget_mib=round(budget["cpu"] / 2 ** 20, 1),
                prefill_ms=round(prefill_s * 1e3, 2), decode_ms=round(statistics.median(warm) * 1e3, 2),
                decode_cold_ms=round(statistics.median(cold) * 1e3, 2) if cold else "",
                disk_kib_per_token=round(statistics.mean(reads) / 1024, 1) if reads else "",
                resident_experts=resident, resident_share=share, tokens_equal=got == want)


def standin(name, folder, meta, budget, prompt, args, work) -> list[dict]:
    """The accelerator path through the stand-in: bytes copied per decode token against the routed experts that are
    not resident; fetched, then computed where their weights live."""
    plan = allocator.plan(meta, budget, runtime="allocator")
    rows = []
    for mode in ("fetch", "compute"):
        with tempfile.TemporaryDirectory(dir=work) as off:
            model = _load(folder, plan.device_map, off)
            layers = find_experts(model)
            keep = max(1, layers[0].num_experts // 4)
            where = {m.experts: ("main",) * keep + ("cpu",) * (m.num_experts - keep) for m in layers}
            runtime = offload.attach(model, None, device="stand-in", experts=where, expert_mode=mode)
            routed: list = []
            hooks = [model.get_submodule(m.experts).register_forward_pre_hook(
                lambda mod, a: routed.append({e for e in a[1].flatten().tolist() if e >= keep})) for m in layers]
            from transformers import DynamicCache

            size = next(iter(runtime.experts.values()))
            size = sum(m[0].numel() * m.element_size() for m in size.metas.values())
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                model(input_ids=prompt, **{cache_keyword(model): cache}, use_cache=True)
                ids = prompt[:, -1:]
                copied0, act0 = runtime.traffic.copied, runtime.traffic.activations
                routed.clear()
                for _ in range(args.tokens):
                    ids = model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits[:, -1].argmax(
                        -1, keepdim=True)
            for h in hooks:
                h.remove()
            n = args.tokens
            rows.append(dict(model=name, row=f"standin-{mode}", model_mib="", ram_budget_mib="", prefill_ms="",
                             decode_ms="", decode_cold_ms="",
                             disk_kib_per_token="",
                             resident_experts=keep * len(layers), tokens_equal="",
                             copied_kib_per_token=round((runtime.traffic.copied - copied0) / n / 1024, 1),
                             routed_nonresident_kib_per_token=round(sum(len(r) for r in routed) * size / n / 1024, 1),
                             activations_kib_per_token=round((runtime.traffic.activations - act0) / n / 1024, 1)))
            offload.detach(model)
    return rows


def _gpt_oss_20b():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
                                  hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                  num_key_value_heads=8, head_dim=64, vocab_size=201088,
                                  layer_types=["sliding_attention", "full_attention"] * 12)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def estimates() -> list[dict]:
    """Cost-model *estimates* (nothing runs): real sizes in bfloat16 on one 24 GiB GPU and 64 GiB of RAM, one decode
    token (``inputs={"input_ids": (1, 1)}``) and a 512-token prefill: accelerate's map (``sequential``) against
    ``plan(runtime="allocator")`` (experts as units)."""
    from allocator.model import zoo

    models = {"qwen3-moe-30b-a3b": lambda: zoo.build("qwen3-moe-30b-a3b"),
              "mixtral-8x7b": lambda: zoo.build("mixtral-8x7b"), "gpt-oss-20b (bf16)": _gpt_oss_20b}
    budget = {0: "24GiB", "cpu": "64GiB"}
    rows = []
    for name, make in models.items():
        model = make()
        for step, inputs in (("decode", (1, 1)), ("prefill", (1, 512))):
            kw = dict(dtype=torch.bfloat16, inputs={"input_ids": inputs})
            theirs = allocator.plan(model, budget, strategy="sequential", **kw)
            ours = allocator.plan(model, budget, runtime="allocator", **kw)
            layers = ours.problem.moe
            on_gpu = sum(row.count(0) for row in ours.experts.values())
            dense_on_gpu = all(d == 0 for k, d in ours.device_map.items() if not any(
                k == m.experts or k.startswith(m.experts + ".") for m in layers))
            for who, p in (("accelerate", theirs), ("ours-experts", ours)):
                rows.append(dict(model=name, step=step, plan=who, valid=p.valid,
                                 estimated_ms=round(p.cost.seconds * 1e3, 1),
                                 streamed_gib=round(p.cost.streamed_bytes / 2 ** 30, 3),
                                 gpu_map_gib=round(p.resident(0) / 2 ** 30, 2),
                                 experts_on_gpu=f"{on_gpu}/{sum(m.num_experts for m in layers)}" if who != "accelerate"
                                 else "", all_but_experts_on_gpu=dense_on_gpu if who != "accelerate" else ""))
    return rows


def report(rows, command: str, started: str, seconds: float, setting: str = "") -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [f"`{command}`, {started}, {seconds:.0f} s, {cores()}, load average at start "
             f"{os.getloadavg()[0]:.2f}" + (f"; {setting}" if setting else ""), "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def interleaved(name: str, family: str, fields: dict, args, work: Path) -> list[dict]:
    """The issue's comparison made robust to a shared machine: the model in RAM, transformers' own load and ours
    through ``patch(runtime="allocator")`` (without and with a profile) loaded side by side, then ``--interleaved``
    rounds, each timing every row's warm decode (median ms per token) one after another. Per row: the median and the
    best round; ratios are taken within each round (the rows of a round see the same load) and their median reported
    (``vs_ram``: the row's time over the model in RAM; ``vs_transformers``: transformers' time over the row's)."""
    folder, ref, meta, total, budget, prompt = _saved(name, family, fields, args, work)
    want, _, _ = decode(ref, prompt, args.tokens)
    profile = allocator.profile_experts(ref, [torch.cat([prompt, torch.tensor([want])], dim=1)])
    loads = {"ram": lambda: _load(folder), "transformers": lambda: _load(folder, "auto", work / "off-hf",
                                                                          max_memory=budget),
             "ours-patch": lambda: _patched(folder, work / "off-ours", budget)[0],
             "ours-patch-profiled": lambda: _patched(folder, work / "off-prof", budget, expert_profile=profile)[0]}
    models, first = {}, {}
    for row, load in loads.items():   # each load, then the first two generate calls after it, timed
        models[row], first[row] = _first_generates(load, prompt, args.tokens)
    equal = {row: decode(model, prompt, args.tokens)[0] == want for row, model in models.items()}   # warms them too
    times: dict = {row: [] for row in models}
    for _ in range(args.interleaved):
        for row, model in models.items():
            times[row].append(statistics.median(decode(model, prompt, args.tokens)[1][1:]))
    rows = []
    for row in models:
        rows.append(dict(model=name, row=row, model_mib=round(total / 2 ** 20, 1),
                         ram_budget_mib=round(budget["cpu"] / 2 ** 20, 1), rounds=args.interleaved,
                         decode_ms_median=round(statistics.median(times[row]) * 1e3, 2),
                         decode_ms_best=round(min(times[row]) * 1e3, 2),
                         vs_ram=round(statistics.median(a / b for a, b in zip(times[row], times["ram"])), 3),
                         vs_transformers=round(statistics.median(
                             a / b for a, b in zip(times["transformers"], times[row])), 2),
                         **first[row], tokens_equal=equal[row]))
    for row, model in models.items():
        if offload.runtime_of(model) is not None:
            offload.detach(model)
    return rows


def _first_generates(load, prompt, tokens: int):
    """The model ``load()`` returns, and the seconds of the load and of the first two greedy ``generate`` calls of
    ``tokens`` new tokens after it (``load_s``, ``generate_1_s``, ``generate_2_s``)."""
    t0 = time.perf_counter()
    model = load()
    out = {"load_s": round(time.perf_counter() - t0, 3)}
    for i in (1, 2):
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        out[f"generate_{i}_s"] = round(time.perf_counter() - t0, 3)
    return model, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--ram", type=float, default=0.3, help="RAM budget as a share of the model's bytes")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--no-standin", dest="standin", action="store_false")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--estimates", action="store_true", help="only the cost-model estimates at real sizes")
    ap.add_argument("--cache-only", action="store_true",
                    help="only the skewed-routing rows (expert cache: hit rate measured and estimated) of the Qwen3 "
                         "shape")
    ap.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                    help="only the model in RAM, transformers and ours through patch() (without and with a profile), "
                         "loaded side by side and timed in ROUNDS interleaved rounds (ratios within each round)")
    add_contention_arguments(ap, "the rows: a shared machine")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    quiet()
    threads = args.threads if args.threads is not None else (0 if args.contention else 1)
    if threads:
        torch.set_num_threads(threads)
    args.threads_used = torch.get_num_threads()
    if args.estimates:
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        t0 = time.time()
        rows = estimates()
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "moe_estimates.csv", rows)
        text = report(rows, "python benchmarks/moe.py --estimates", started, time.time() - t0)
        (args.out / "moe_estimates.md").write_text(text)
        print(text)
        return 0
    shapes = SMOKE if args.smoke else {k: SHAPES[k] for k in args.models}
    if args.smoke:
        args.tokens, args.prompt = 3, 8
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.time()
    rows = []
    busy = Contention(args.contention)
    with tempfile.TemporaryDirectory() as work, busy:
        for name, (family, fields) in shapes.items():
            if args.interleaved:
                rows += interleaved(name, family, fields, args, Path(work))
                continue
            if args.cache_only:
                if name.startswith("qwen3"):
                    rows += cache_rows(name, family, fields, args, Path(work))
                continue
            rows += measure(name, family, fields, args, Path(work))
            print(f"{name}: done", file=sys.stderr)
    command = "python benchmarks/moe.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    stem = "moe_interleaved" if args.interleaved else "moe_smoke" if args.smoke else "moe"
    write_csv(args.out / f"{stem}.csv", [{k: r.get(k, "") for k in keys} for r in rows])
    text = report(rows, command.strip(), started, time.time() - t0,
                  f"torch threads {args.threads_used}, contention: {busy.describe()}")
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
