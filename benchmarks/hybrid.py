"""Hybrid execution measured without a GPU (issue #40): a plan made for an accelerator main device run on this machine
with :class:`allocator.offload.StandInDevice` as the accelerator.

Per model (tiny configs of transformers' config classes, float32, seeded random weights, saved with
``save_pretrained``): ``allocator.plan(meta, {0: 40 % of the model, "cpu": 4x}, runtime="allocator",
generation=GenerationBudget(1, --context, prompt_length=--prompt))``, once with ``split_layers=False`` (whole layers)
and once as by default (the planner may split decoder layers, issue #49). Each map is loaded here with the
accelerator's units on ``cpu`` (the stand-in's memory) and the offloaded units on ``disk`` (memory-mapped files: RAM
once the page cache holds them), then run by ``allocator.offload.attach(model, plan, device="stand-in")``:

- ``stream``: the whole-layer plan without its compute map: every offloaded unit's weights "copied to the GPU" at
  every call;
- ``hybrid``: the whole-layer plan as made: units computing on the CPU in a phase read their weights where they live;
- ``split`` (issue #49): the planner's own plan (no hand rewriting): where its ``"sublayer"`` decision chose it, some
  decoder layers split, their attention, norms and KV cache on the accelerator, their MLP where its weights live,
  computed as its compute map says. ``split_reason`` is that decision's reason (``faster``: split; ``slower``,
  ``none-fits``, ``fewer-bytes``: kept whole, so the row runs the whole-layer plan again).

Rows per model, runtime and phase: ``copied_kib_per_token`` (the stand-in's copies: bytes staged, per token),
``activations_kib_per_token`` (inputs and outputs the hybrid hooks moved), ``moves_to_host_per_token`` and
``moves_to_main_per_token`` (activation moves between RAM and the accelerator, counted by the stand-in:
``StandInDevice.moves``; one move carries a part's inputs or output), ``cache_moves`` (KV cache layers moved, all
tokens), ``split_layers`` (layers whose attention the plan keeps on the accelerator, their MLP offloaded),
``split_reason``, ``cpu_units_at_decode`` (units of the compute map computed in RAM at decode: a split
layer's MLP is one), ``ms_per_token`` (CPU time measured here; the stand-in's "copies" are clones in RAM, not
timed as a GPU), ``max_abs_diff`` of the logits against the model in RAM and ``tokens_equal`` (greedy decode).
GPU-side times are *estimates*: ``--estimates`` adds the cost model's steps at real sizes (nothing runs).

    python benchmarks/hybrid.py --standin --smoke     # llama and qwen3, a few tokens (about 1 min)
    python benchmarks/hybrid.py --standin --context 33 # plan for the run's own length (the planner keeps layers whole)
    python benchmarks/hybrid.py --standin             # + mistral and gemma
    python benchmarks/hybrid.py --estimates           # llama-70b, llama-8b, qwen3-32b estimates only

Writes ``results/hybrid.csv`` (``--out`` for another folder); ``--estimates`` writes ``hybrid_estimates.csv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import allocator
from allocator.model.cache_kwarg import cache_keyword
from allocator import offload

sys.path.insert(0, str(Path(__file__).parent))
from benchutil import quiet, write_csv  # noqa: E402

OUT = Path(__file__).parent / "results"
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 32}),
}
SMOKE = ("llama", "qwen3")


def _build(name: str, device=None):
    import transformers

    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return getattr(transformers, model_cls)(config).eval()


def _greedy(model, prompt, tokens: int):
    """Prefill logits, then ``tokens`` greedy decode steps with a KV cache: (prefill logits, decode logits, ids,
    seconds of the prefill, seconds of the decode)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        first = model(input_ids=prompt, **{cache_keyword(model): cache}, use_cache=True).logits
        t1 = time.perf_counter()
        ids, logits, out = first[:, -1:].argmax(-1), [], []
        for _ in range(tokens):
            step = model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits
            logits.append(step)
            ids = step[:, -1:].argmax(-1)
            out.append(int(ids))
        t2 = time.perf_counter()
    return first, torch.cat(logits, 1), out, t1 - t0, t2 - t1


def _staged(runtime) -> int:
    """Bytes the stand-in copied "to the GPU": modules' weights staged, and expert slices (its log's copies)."""
    return runtime.device.staged + sum(entry[1] for entry in runtime.device.log if entry[0] == "copy")


def decode_run(folder, plan, device_map, kind: str, prompt, tokens: int, work, *, device=None, dtype=torch.float32):
    """Load ``folder`` with ``device_map``, attach the runtime with ``plan`` (``kind="stream"``: without its compute
    map), run a prefill of ``prompt`` and ``tokens`` greedy decode steps: per phase the bytes staged (the stand-in's
    copies), activations moved, seconds, logits; the greedy ids; the GPU's peak where there is one."""
    from transformers import AutoModelForCausalLM, DynamicCache

    run_plan = dataclasses.replace(plan, device_map=device_map, hybrid=None if kind == "stream" else plan.hybrid)
    cuda = device is None and torch.cuda.is_available()
    with tempfile.TemporaryDirectory(dir=work) as off:
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=off,
                                                     dtype=dtype).eval()
        runtime = offload.attach(model, run_plan, device=device, prefetch=0)
        standin = isinstance(runtime.device, offload.StandInDevice)
        staged = (lambda: _staged(runtime)) if standin else (lambda: 0)
        moves = (lambda: dict(runtime.device.moves)) if isinstance(runtime.device, offload.StreamDevice) else dict
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ids_in = runtime.device.put(prompt) if standin else prompt.to("cuda:0" if cuda else "cpu")   # as users send it
        try:
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                s0, a0, m0 = staged(), runtime.traffic.activations, moves()
                t0 = time.perf_counter()
                first = model(input_ids=ids_in, **{cache_keyword(model): cache}, use_cache=True).logits
                sync()
                t1 = time.perf_counter()
                s1, a1, m1 = staged(), runtime.traffic.activations, moves()
                ids, logits, out = first[:, -1:].argmax(-1), [], []
                for _ in range(tokens):
                    step = model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits
                    logits.append(step)
                    ids = step[:, -1:].argmax(-1)
                    out.append(int(ids))
                sync()
                t2 = time.perf_counter()
                s2, a2, m2 = staged(), runtime.traffic.activations, moves()
        finally:
            offload.detach(model)
    return dict(prefill=(s1 - s0, a1 - a0, t1 - t0, first.float().cpu()),
                decode=(s2 - s1, a2 - a1, t2 - t1, torch.cat(logits, 1).float().cpu()), ids=out,
                moves=dict(prefill=_delta(m1, m0), decode=_delta(m2, m1)),
                gpu_peak=torch.cuda.max_memory_allocated() if cuda else None)


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def planned_pair(meta, budget: dict, generation) -> tuple:
    """The whole-layer plan (``split_layers=False``) and the planner's own plan for ``budget`` under our runtime,
    the layers the latter splits with their attention on the main device (issue #49), and its ``"sublayer"``
    decision's reason (``""`` where it made none)."""
    options = dict(runtime="allocator", generation=generation)
    whole = allocator.plan(meta, budget, split_layers=False, **options)
    split = allocator.plan(meta, budget, **options)
    said = split.placement.of_kind("sublayer")
    near = [s.layer for s in split.problem.splits
            if s.layer not in split.device_map and split.device_map.get(s.far) in ("cpu", "disk")
            and all(split.device_map.get(n) == split.main_device for n in s.near)]
    return whole, split, near, said[0].reason if said else ""


def run_model(name: str, args, work: str) -> list[dict]:
    ram = _build(name)
    folder = os.path.join(work, name)
    ram.save_pretrained(folder)
    prompt = torch.randint(0, TINY["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ref = _greedy(ram, prompt, args.tokens)
    total = sum(p.numel() * p.element_size() for p in ram.parameters())
    budget = {0: int(total * 0.4), "cpu": 4 * total}
    generation = allocator.GenerationBudget(1, max(args.context, args.prompt + args.tokens + 1),
                                            prompt_length=args.prompt)
    plan, split, split_layers, reason = planned_pair(_build(name, "meta"), budget, generation)
    assert plan.main_device == 0 and plan.compute, (name, plan.device_map)
    in_ram = sum(plan.resident(d) for d in ("cpu", "disk"))
    rows = []
    for kind in RUNTIMES:
        run = split if kind == "split" else plan
        # the accelerator's units in the stand-in's memory, the offloaded ones in memory-mapped files
        device_map = {k: ("disk" if v in ("cpu", "disk") else "cpu") for k, v in run.device_map.items()}
        got = decode_run(folder, run, device_map, kind, prompt, args.tokens, work, device="stand-in")
        for phase, n, want in (("prefill", args.prompt, ref[0]), ("decode", args.tokens, ref[1])):
            staged, moved, seconds, logits = got[phase]
            moves = got["moves"][phase]
            rows.append(dict(model=name, phase=phase, runtime=kind, tokens=n,
                             weights_in_ram_kib=round(in_ram / 1024, 1),
                             copied_kib_per_token=round(staged / n / 1024, 2),
                             copied_share_of_ram_weights=round(staged / n / in_ram, 4) if phase == "decode" else "",
                             activations_kib_per_token=round(moved / n / 1024, 2),
                             moves_to_host_per_token=round(moves.get(("activations", "to_host"), 0) / n, 2),
                             moves_to_main_per_token=round(moves.get(("activations", "to_main"), 0) / n, 2),
                             cache_moves=sum(v for (what, _), v in moves.items() if what == "cache"),
                             split_layers=len(split_layers) if kind == "split" else 0,
                             split_reason=reason if kind == "split" else "",
                             cpu_units_at_decode=0 if kind == "stream" else sum(
                                 v["decode"] == "cpu" for v in run.compute.values()),
                             ms_per_token=round(seconds / n * 1e3, 3),
                             max_abs_diff=float((logits - want).abs().max()),
                             tokens_equal=got["ids"] == ref[2] if phase == "decode" else ""))
    return rows


def gpu_case(path, meta, total: int, fraction: float, work, *, dry_run: bool, tokens: int = 16,
             prompt_tokens: int = 32, context: int = 128) -> list[dict]:
    """``benchmarks/gpu.py``'s hybrid case: one saved model, a plan for ``{0: fraction x model, "cpu": 4x}`` with
    ``runtime="allocator"`` and a generation budget (``context`` tokens, at least the run's), run streamed, hybrid
    and split (:func:`planned_pair`, issue #49): decode tokens per second, the GPU's peak (``max_memory_allocated``),
    activation moves per decode token, greedy tokens of each equal to the streamed run's. In a dry run the stand-in
    is the accelerator (the map loaded as :func:`run_model` loads it) and the times are CPU times, not a GPU's. The
    split row runs the planner's own plan (whole layers where its ``"sublayer"`` decision says so:
    ``split_reason``)."""
    budget = {0: int(fraction * total), "cpu": 4 * total}
    generation = allocator.GenerationBudget(1, max(context, prompt_tokens + tokens + 1), prompt_length=prompt_tokens)
    plan, split, split_layers, reason = planned_pair(meta, budget, generation)
    if not plan.compute:
        return [dict(runtime=k, status=f"no compute map (main device {plan.main_device!r})") for k in RUNTIMES]
    prompt = torch.randint(0, 1000, (1, prompt_tokens), generator=torch.Generator().manual_seed(2))
    dtype = torch.float32 if dry_run else torch.bfloat16
    got = {}
    for k in RUNTIMES:
        run = split if k == "split" else plan
        device_map = ({d: ("disk" if v in ("cpu", "disk") else "cpu") for d, v in run.device_map.items()} if dry_run
                      else run.device_map)
        got[k] = decode_run(path, run, device_map, k, prompt, tokens, work, device="stand-in" if dry_run else None,
                            dtype=dtype)
    rows = []
    for k in RUNTIMES:
        seconds = got[k]["decode"][2]
        moves = got[k]["moves"]["decode"]
        rows.append(dict(runtime=k, status="ok", device="stand-in (CPU times)" if dry_run else "cuda:0",
                         decode_tokens_per_s=round(tokens / seconds, 2), prefill_s=round(got[k]["prefill"][2], 4),
                         gpu_peak_bytes="" if got[k]["gpu_peak"] is None else got[k]["gpu_peak"],
                         planned_peak_bytes=int((split if k == "split" else plan).peak.get(0, 0)),
                         estimated_decode_s=round((split if k == "split" else plan).phase_steps[
                             "hybrid" if k == "split" else k]["decode"], 6),
                         units_on_cpu_at_decode=sum(v["decode"] == "cpu" for v in
                                                    (split if k == "split" else plan).compute.values()),
                         split_layers=len(split_layers) if k == "split" else 0,
                         split_reason=reason if k == "split" else "",
                         moves_per_decode_token=round(sum(v for (what, _), v in moves.items()
                                                          if what == "activations") / tokens, 2),
                         tokens_equal=got[k]["ids"] == got["stream"]["ids"]))
    return rows


RUNTIMES = ("stream", "hybrid", "split")


def _qwen3_32b():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
    with torch.device("meta"):
        return Qwen3ForCausalLM(config)


def estimates() -> list[dict]:
    """Cost-model *estimates* (nothing runs), bfloat16, ``GenerationBudget(1, 4096)``: accelerate's hooks, our runtime
    streaming every offloaded unit, and our runtime as the plan computes them (hybrid); seconds per step."""
    from allocator.evaluate.compute import step_seconds
    from allocator.model import zoo

    cases = [("llama-70b", lambda: zoo.build("llama-70b"), {0: "24GiB", "cpu": "192GiB"}),
             ("llama-8b", lambda: zoo.build("llama-8b"), {0: "8GiB", "cpu": "64GiB"}),
             ("qwen3-32b", _qwen3_32b, {0: "16GiB", "cpu": "64GiB"})]
    rows = []
    for name, build, budget in cases:
        meta = build()
        options = dict(generation=allocator.GenerationBudget(1, 4096), dtype=torch.bfloat16)
        theirs = allocator.plan(meta, budget, runtime="accelerate", **options)
        ours = allocator.plan(meta, budget, runtime="allocator", **options)
        on_cpu = sum(1 for v in ours.compute.values() if v["decode"] == "cpu")
        for phase in ("prefill", "decode"):
            acc = step_seconds(theirs.problem, theirs.device_map, theirs.main_device, phase, None,
                               runtime="accelerate")
            steps = ours.phase_steps
            rows.append(dict(model=name, budget=str(budget), phase=phase,
                             accelerate_s=round(acc, 3), stream_s=round(steps["stream"][phase], 3),
                             hybrid_s=round(steps["hybrid"][phase], 3),
                             speedup_vs_accelerate=round(acc / steps["hybrid"][phase], 2),
                             units_on_cpu_at_decode=on_cpu, offloaded_units=len(ours.compute),
                             peak_gpu_gib=round(ours.peak.get(0, 0) / 2**30, 2),
                             peak_cpu_gib=round(ours.peak.get("cpu", 0) / 2**30, 2), kind="estimate"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--standin", action="store_true", help="run plans for an accelerator with the stand-in")
    ap.add_argument("--smoke", action="store_true", help="two architectures, a few tokens")
    ap.add_argument("--estimates", action="store_true", help="cost-model estimates at real sizes (nothing runs)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--context", type=int, default=128,
                    help="the generation budget's length the plans are made for (at least prompt + tokens + 1)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    quiet()
    args.tokens = args.tokens or (4 if args.smoke else 16)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.standin or not args.estimates:
        rows = []
        with tempfile.TemporaryDirectory() as work:
            for name in (SMOKE if args.smoke else MODELS):
                rows += run_model(name, args, work)
        for row in rows:
            row["measured"] = stamp
        write_csv(args.out / "hybrid.csv", rows)
        for row in rows:
            print(row)
    if args.estimates:
        rows = estimates()
        write_csv(args.out / "hybrid_estimates.csv", rows)
        for row in rows:
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
