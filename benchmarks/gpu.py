"""GPU benchmark: our plan against transformers' ``device_map="auto"`` on a real accelerator, in one command.

Three random llama-like models of different shapes (wide layers, many thin layers, a 128k vocabulary whose
``lm_head`` is the largest layer) are sized to the machine: each is about ``--model-gib`` GiB in bfloat16, less
where GPU memory, RAM or disk are short. Each is built on the GPU, saved with ``save_pretrained`` (safetensors)
to a temporary folder, and for GPU budgets of 30/50/70 % of the model (``{0: f * total, "cpu": 2 * total}``)
loaded twice by ``from_pretrained``: with ``device_map="auto"`` and with ``allocator.plan(meta_twin,
budget).device_map``. Per load: median latency of 20 forwards after 3 warm-ups (batch 1, 32 tokens,
``torch.cuda.synchronize`` around each), ``torch.cuda.max_memory_allocated`` over the forwards (reset after
loading), the memory allocated after loading, the bytes the map keeps on GPU 0, and the peak on GPU 0 that
``allocator`` predicts for the map (``plan.peak[0]`` for ours; :func:`allocator.evaluate.validate.check` for auto's).

Generate case: per model, one budget (``--gen-budget`` of the model on GPU 0) and a :class:`allocator.GenerationBudget`
(``--gen-batch`` sequences of ``--gen-length`` tokens, the last ``--gen-new`` of them generated). Both maps — ``auto``
and ``allocator.plan(..., generation=budget)`` — are loaded and run ``generate``; the table compares
``torch.cuda.max_memory_allocated`` during ``generate`` (minus what was allocated before loading) with the peak
``allocator`` predicts for the map *with* the generation budget (weights + KV cache + logits + activations), and says
which map stays within the budget. In a dry run the CPU is the device and the measured peak is the RAM the loaded
model holds plus what ``generate`` allocates at once (every allocation, traced by the torch profiler).

Built to finish within 8 minutes on one GPU: configurations left when ``--time-limit`` seconds have passed are
reported as skipped. Writes ``gpu.csv``, ``gpu_generate.csv`` and ``gpu.md`` into ``--out``.

Hybrid case (issue #40, ``--hybrid-budget``): the first model, planned with ``runtime="allocator"`` and a generation
budget, decoded with its compute map (offloaded units on the CPU at decode where the plan says), streamed, and split
(issue #49: the planner's own plan, some decoder layers' attention and KV cache on the GPU and their MLP in RAM where
its ``"sublayer"`` decision chooses it, :func:`hybrid.planned_pair`): decode tokens per second, the GPU's peak,
activation moves per decode token, greedy tokens equal; ``gpu_hybrid.csv`` (:func:`hybrid.gpu_case`).

    python benchmarks/gpu.py              # on a machine with a CUDA GPU
    python benchmarks/gpu.py --dry-run    # anywhere, in seconds: tiny models, the CPU as the device, disk offload
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import allocator
from allocator.model.cache_kwarg import cache_keyword
from allocator.evaluate.memory import main_device, tensor_devices
from allocator.evaluate.validate import check

from benchutil import quiet, ram_held, write_csv
from hybrid import gpu_case as hybrid_case   # issues #40, #49: stream vs hybrid vs split decode
import gpu_pipelines   # issue #47: a diffusion pipeline, assisted generation

OUT = Path(__file__).parent / "results"
BUDGETS = (0.3, 0.5, 0.7)
METHODS = ("auto", "ours")

# name -> llama config fields without num_hidden_layers (chosen to reach the target size), and a description.
SHAPES = {
    "llama-wide": (dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8,
                        vocab_size=32000), "4096 wide, few layers"),
    "llama-deep": (dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                        vocab_size=32000), "1024 wide, many layers"),
    "llama-vocab": (dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
                         vocab_size=128256), "128k vocabulary: lm_head is the largest layer"),
}
# Dry run: the same shapes, 16x narrower.
DRY_SHAPES = {
    "llama-wide": dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2000),
    "llama-deep": dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2000),
    "llama-vocab": dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=4000),
}


def _config(fields: dict, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**fields, num_hidden_layers=layers, max_position_embeddings=256, tie_word_embeddings=False)


def _meta(config, dtype):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config).to(dtype)


def _bytes(model) -> int:
    return allocator.build_problem(model, {"cpu": 0}).graph.total


def size_config(fields: dict, target: int, dtype):
    """A config with as many layers as bring the model closest to ``target`` bytes (at least one layer)."""
    one, two = _bytes(_meta(_config(fields, 1), dtype)), _bytes(_meta(_config(fields, 2), dtype))
    per_layer, fixed = two - one, one - (two - one)
    layers = max(1, round((target - fixed) / per_layer))
    return _config(fields, layers), layers


def model_target_bytes(args) -> tuple[int, str]:
    """Bytes per model: ``--model-gib``, less where the GPU, RAM or disk is short; and why."""
    want = int(args.model_gib * 2**30)
    limits = {"--model-gib": want}
    if not args.dry_run:
        free, _ = torch.cuda.mem_get_info(0)
        limits["40% of free GPU memory"] = int(0.4 * free)  # built on the GPU, then the largest budget (70%) fits
    try:
        import psutil

        limits["25% of available RAM"] = int(0.25 * psutil.virtual_memory().available)
    except ImportError:
        pass
    limits["30% of free disk / 3"] = int(0.3 * shutil.disk_usage(tempfile.gettempdir()).free / 3)
    reason = min(limits, key=limits.get)
    return limits[reason], reason


# --------------------------------------------------------------------------------------------------------------
# Measurements.

class Device:
    """The device under test: ``cuda:0`` with its memory counters, or (dry run) the CPU with none."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.key = "cpu" if dry_run else 0
        self.name = "cpu (dry run)" if dry_run else torch.cuda.get_device_name(0)

    def sync(self) -> None:
        if not self.dry_run:
            torch.cuda.synchronize()

    def reset(self) -> int | None:
        """Free what the last load left and zero the peak counter; the bytes still allocated (GPU only)."""
        if self.dry_run:
            return None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int | None:
        return None if self.dry_run else torch.cuda.max_memory_allocated()

    def allocated(self) -> int | None:
        return None if self.dry_run else torch.cuda.memory_allocated()

    @contextlib.contextmanager
    def tracking(self, mapped=()):
        """Dry run: trace every CPU allocation of the block with the torch profiler; ``traced`` is their peak.

        Allocations of exactly a size in ``mapped`` are left out: they are memory maps of the checkpoint files
        (safetensors maps a whole file to read one offloaded tensor), paged in lazily from the page cache."""
        self.traced = None
        if not self.dry_run:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        events = sorted((e for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]" and abs(e.nbytes()) not in mapped), key=lambda e: e.start_ns())
        current = self.traced = 0
        for e in events:
            current += e.nbytes()
            self.traced = max(self.traced, current)

    def budget(self, f: float, total: int) -> dict:
        # Dry run: the CPU is main and the rest goes to disk, as on a machine without an accelerator.
        return {"cpu": int(f * total)} if self.dry_run else {0: int(f * total), "cpu": 2 * total}


def _load(path, device_map, budget, args, offload):
    """The saved llama loaded with ``device_map``, and the map transformers really used."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=args.dtype, device_map=device_map, max_memory=dict(budget),
                                             offload_folder=offload).eval()
    return model, dict(getattr(model, "hf_device_map", {}))


def run_load(path, device_map, budget, device: Device, inputs, args, offload) -> dict:
    """Load once, time forwards, read memory; ``status`` says what went wrong if anything did."""
    model = None
    base = device.reset()
    try:
        model, loaded_map = _load(path, device_map, budget, args, offload)
        after_load = device.allocated()
        times = []
        with torch.no_grad():
            for _ in range(args.warmup):
                model(**inputs)
            device.sync()
            if not device.dry_run:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.forwards):
                device.sync()
                start = time.perf_counter()
                model(**inputs)
                device.sync()
                times.append(time.perf_counter() - start)
        peak = device.peak()
        return dict(status="ok", device_map=loaded_map, times=times,
                    after_load=None if after_load is None else after_load - base,
                    peak=None if peak is None else peak - base)
    except torch.cuda.OutOfMemoryError as err:
        return dict(status=f"out of memory: {str(err).splitlines()[0][:120]}", device_map=None, times=[],
                    after_load=None, peak=None)
    finally:
        del model  # collected by the next load's reset


def generation_budget(args) -> allocator.GenerationBudget:
    return allocator.GenerationBudget(args.gen_batch, args.gen_length, prompt_length=args.gen_length - args.gen_new)


def run_generate(path, device_map, budget, device: Device, args, offload) -> dict:
    """Load once and run ``generate`` with the generation budget's batch and lengths; its peak memory."""
    model = None
    base = device.reset()
    try:
        model, loaded_map = _load(path, device_map, budget, args, offload)
        after_load = device.allocated()
        prompt = args.gen_length - args.gen_new
        ids = torch.randint(3, 2000, (args.gen_batch, prompt), generator=torch.Generator().manual_seed(0))
        # Inputs on the main device, where the hooks return outputs and generate keeps its scores.
        main = main_device(loaded_map.values()) if loaded_map else ("cpu" if device.dry_run else 0)
        ids = ids.to(f"cuda:{main}" if isinstance(main, int) else "cpu")
        if not device.dry_run:
            torch.cuda.reset_peak_memory_stats()  # the peak of generate, not of loading
        mapped = {p.stat().st_size for p in Path(path).glob("*.safetensors")}
        with torch.no_grad(), device.tracking(mapped):
            device.sync()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=args.gen_new, min_new_tokens=args.gen_new, do_sample=False,
                           pad_token_id=0)
            device.sync()
            seconds = time.perf_counter() - start
        peak = ram_held(model) + device.traced if device.dry_run else device.peak() - base
        return dict(status="ok", device_map=loaded_map, times=[seconds],
                    after_load=None if after_load is None else after_load - base, peak=peak)
    except torch.cuda.OutOfMemoryError as err:
        return dict(status=f"out of memory: {str(err).splitlines()[0][:120]}", device_map=None, times=[],
                    after_load=None, peak=None)
    finally:
        del model


def measure_generate(args, device: Device, workdir: Path, name, layers, total, meta, path, deadline) -> list[dict]:
    """The generate case of one saved model: ``auto`` and our plan with the generation budget."""
    f = args.gen_budget
    budget = device.budget(f, total)
    problem = allocator.build_problem(meta, dict(budget), generation=generation_budget(args))
    try:
        plan, no_plan = allocator.plan(meta, dict(budget), generation=generation_budget(args)), None
    except allocator.InfeasiblePlacement as err:
        plan, no_plan = None, f"no plan: needs {err.minimum} B on {err.device!r}"
    rows = []
    for method in METHODS:
        if time.time() > deadline:
            result = dict(status="skipped: time limit", device_map=None, times=[], after_load=None, peak=None)
        elif method == "ours" and plan is None:
            result = dict(status=no_plan, device_map=None, times=[], after_load=None, peak=None)
        else:
            with tempfile.TemporaryDirectory(dir=workdir) as offload:
                result = run_generate(path, "auto" if method == "auto" else plan.device_map, budget, device, args,
                                      offload)
        row = _row(name, layers, total, f, method, budget, problem, plan, result, device)
        row["generate_s"] = f"{result['times'][0]:.3f}" if result["times"] else ""
        for key in ("n", "median_ms", "q1_ms", "q3_ms"):
            del row[key]
        rows.append(row)
        print(f"{name} generate {f:.0%} {method}: {row['status']}, peak {row['measured_peak_bytes'] or '—'} B, "
              f"predicted {row['predicted_peak_bytes'] or '—'} B", file=sys.stderr, flush=True)
    return rows


RUNTIMES = ("hooks", "ours-0", "ours-1")


def measure_runtime(args, device: Device, workdir: Path, name, total, meta, path, inputs, deadline) -> list[dict]:
    """The runtime case of one saved model: one map (planned for ``runtime="allocator", prefetch=1``), loaded once per
    runtime: accelerate's hooks, ours without prefetch, ours one module ahead (on a GPU: pinned host copies on a side
    stream; in a dry run also ``ours-1-standin``, the same stream scheduling with the CPU stand-in for a GPU).
    Forwards take turns; each output is compared with the hooks' (``torch.equal``); per runtime the transient peak of
    a forward (GPU: ``max_memory_allocated`` minus what was allocated before it) and our runtime's ``peak_held``,
    next to what the plan reserves for streaming (chain + prefetch)."""
    from allocator import offload

    f = args.runtime_budget
    budget = device.budget(f, total)
    try:
        plan = allocator.plan(meta, dict(budget), runtime="allocator", prefetch=1)
    except allocator.InfeasiblePlacement as err:
        return [dict(model=name, budget=f, runtime=r, status=f"no plan: needs {err.minimum} B on {err.device!r}")
                for r in RUNTIMES]
    if time.time() > deadline:
        return [dict(model=name, budget=f, runtime=r, status="skipped: time limit") for r in RUNTIMES]
    runtimes = [*RUNTIMES, *(["ours-1-standin"] if device.dry_run else [])]
    rows, models, attached = [], {}, {}
    with tempfile.TemporaryDirectory(dir=workdir) as offload_root:
        try:
            for r in runtimes:
                models[r], _ = _load(path, plan.device_map, budget, args, str(Path(offload_root) / r))
                if r != "hooks":
                    attached[r] = offload.attach(models[r], plan.device_map, prefetch=int(r.split("-")[1]),
                                                 device="stand-in" if r.endswith("standin") else None)
        except torch.cuda.OutOfMemoryError as err:
            return [dict(model=name, budget=f, runtime=r, status=f"out of memory: {str(err)[:100]}")
                    for r in runtimes]
        times = {r: [] for r in runtimes}
        transient = dict.fromkeys(runtimes, 0)
        equal = dict.fromkeys(runtimes, True)
        with torch.no_grad():
            for i in range(args.warmup + args.forwards):
                k = i % len(runtimes)
                outs = {}
                for r in runtimes[k:] + runtimes[:k]:
                    device.sync()
                    before = device.allocated()
                    if not device.dry_run:
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    outs[r] = models[r](**inputs).logits
                    device.sync()
                    if i >= args.warmup:
                        times[r].append(time.perf_counter() - start)
                        if before is not None:
                            transient[r] = max(transient[r], device.peak() - before)
                for r in runtimes:
                    equal[r] &= bool(torch.equal(outs[r], outs["hooks"]))
        for r in attached:
            offload.detach(models[r])
    hooks = statistics.median(times["hooks"])
    for r in runtimes:
        med = statistics.median(times[r])
        rows.append(dict(model=name, budget=f, runtime=r, status="ok", median_ms=f"{med * 1e3:.3f}",
                         speedup=f"{hooks / med:.2f}", equal=equal[r],
                         transient_peak_bytes="" if device.dry_run else transient[r],
                         peak_held_bytes=attached[r].peak_held if r in attached else "",
                         reserve_bytes=plan.streamed + plan.prefetch))
        print(f"{name} runtime {f:.0%} {r}: {med * 1e3:.3f} ms, equal {equal[r]}", file=sys.stderr, flush=True)
    return rows


# Mixture of experts: the Qwen3-MoE shape (64 experts, top-4), sized to the machine.
MOE_FIELDS = dict(num_experts=64, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=32000)
MOE_REAL = dict(hidden_size=1024, moe_intermediate_size=384, intermediate_size=2048, head_dim=128,
                num_hidden_layers=24)
MOE_DRY = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, head_dim=8, num_hidden_layers=8,
               vocab_size=2000)


def measure_moe(args, device: Device, workdir: Path, deadline) -> list[dict]:
    """The MoE case: a Qwen3-MoE-shaped model (64 experts, top-4) saved once and loaded with ``device_map="auto"``
    (accelerate's hooks) and with ``allocator.plan(meta, budget, runtime="allocator")`` plus
    :func:`allocator.offload.attach` (experts as units: what runs for every token on the device, the room left holding
    experts, only routed experts fetched or computed on the CPU). Per load: greedy decode of ``--moe-tokens`` tokens
    with a KV cache (ms per token, median), whether the tokens equal auto's, and for ours the bytes copied to the
    device per token against the bytes of the routed experts not resident (counted from the routers' choices)."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from allocator import offload
    from allocator.model.experts import find_experts

    fields = {**MOE_FIELDS, **(MOE_DRY if device.dry_run else MOE_REAL)}
    config = AutoConfig.for_model("qwen3_moe", **fields)
    torch.manual_seed(0)
    path = workdir / "qwen3-moe"
    AutoModelForCausalLM.from_config(config).to(args.dtype).save_pretrained(path)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    total = allocator.build_problem(meta, {"cpu": 0}, dtype=args.dtype).graph.total
    budget = device.budget(args.moe_budget, total)
    prompt = torch.randint(0, fields["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(1))
    rows, tokens = [], {}
    for method in ("auto", "ours-experts"):
        if time.time() > deadline:
            rows.append(dict(model="qwen3-moe", method=method, status="skipped: time limit"))
            continue
        with tempfile.TemporaryDirectory(dir=workdir) as off:
            plan = None
            if method == "auto":
                device_map = "auto"
            else:
                plan = allocator.plan(meta, dict(budget), runtime="allocator", dtype=args.dtype)
                device_map = plan.device_map
            model = AutoModelForCausalLM.from_pretrained(path, dtype=args.dtype, device_map=device_map,
                                                         max_memory=dict(budget), offload_folder=off,
                                                         experts_implementation="eager").eval()
            runtime = offload.attach(model, plan) if plan is not None else None
            main = "cpu" if device.dry_run else "cuda:0"
            routed: list = []
            hooks = []
            if runtime is not None:
                for m in find_experts(model):
                    r = next((x for x in runtime.experts.values() if x.layer.experts == m.experts), None)
                    if r is not None:
                        hooks.append(model.get_submodule(m.experts).register_forward_pre_hook(
                            lambda mod, a, r=r: routed.append(len({e for e in a[1].flatten().tolist()
                                                                   if e not in r.rows}))))
            out, times = [], []
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                ids = prompt.to(main)
                copied0 = runtime.traffic.copied if runtime else 0
                for i in range(args.moe_tokens + 1):
                    if i == 1:
                        routed.clear()
                        copied0 = runtime.traffic.copied if runtime else 0
                    device.sync()
                    t0 = time.perf_counter()
                    ids = model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits[:, -1].argmax(
                        -1, keepdim=True)
                    device.sync()
                    if i:
                        times.append(time.perf_counter() - t0)
                    out.append(int(ids))
            for h in hooks:
                h.remove()
            tokens[method] = out
            row = dict(model="qwen3-moe", method=method, status="ok", model_bytes=total,
                       device_budget_bytes=budget[device.key], decode_ms=f"{statistics.median(times) * 1e3:.2f}",
                       tokens_equal_auto=out == tokens.get("auto", out))
            if runtime is not None:
                size = next(iter(runtime.experts.values())) if runtime.experts else None
                size = sum(m[0].numel() * m.element_size() for m in size.metas.values()) if size else 0
                n = max(args.moe_tokens, 1)
                row.update(resident_experts=sum(len(r.rows) for r in runtime.experts.values()),
                           copied_bytes_per_token=(runtime.traffic.copied - copied0) // n,
                           routed_nonresident_bytes_per_token=sum(routed) * size // n,
                           activations_bytes=runtime.traffic.activations)
                offload.detach(model)
            rows.append(row)
            print(f"moe {method}: {row['decode_ms']} ms/token", file=sys.stderr, flush=True)
            del model
    return rows


def runtime_table(rows) -> str:
    lines = ["| model | budget | runtime | status | median ms | speedup vs hooks | output = hooks' | transient peak | "
             "peak held (ours) | plan's streaming reserve |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['budget']:.0%} | {r['runtime']} | {r['status']} | {r.get('median_ms', '')} "
                     f"| {r.get('speedup', '')} | {r.get('equal', '')} | {r.get('transient_peak_bytes', '')} | "
                     f"{r.get('peak_held_bytes', '')} | {r.get('reserve_bytes', '')} |")
    return "\n".join(lines)


def measure_diffusion(args, device: Device, workdir: Path, deadline) -> list[dict]:
    """The diffusion case (:mod:`diffusion`): one denoising step of a random Flux-shaped transformer with
    ``--diffusion-budget`` of it on the device, loaded by diffusers' ``device_map="auto"``, diffusers' group offloading
    (block level, CUDA streams, RAM) and allocator's plan (accelerate's hooks, then the allocator runtime). Per method:
    median ms per step, the device's peak memory, and whether the output equals the model's on the device (bf16:
    rtol/atol 1e-2). In a dry run: the CPU as the device and disk offload, as ``benchmarks/diffusion.py`` runs."""
    import diffusion

    fields = dict(diffusion.SMOKE) if device.dry_run else dict(diffusion.FLUX, num_layers=8, num_single_layers=16,
                                                               attention_head_dim=128, num_attention_heads=16,
                                                               joint_attention_dim=2048, pooled_projection_dim=768)
    where = "cpu" if device.dry_run else "cuda:0"
    path = workdir / "flux"
    diffusion.build(path, fields, where, args.dtype)
    reference = torch.load(path / "reference.pt")
    tolerance = dict(rtol=1e-4, atol=1e-5) if args.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    rows = []
    for method in diffusion.METHODS:
        if time.time() > deadline:
            rows.append({"method": method, "status": "skipped (time limit)"})
            continue
        with tempfile.TemporaryDirectory(dir=workdir) as work:
            try:
                row = diffusion.one(method, path, args.diffusion_budget, args.forwards, Path(work), device=where,
                                    fields=fields, dtype=args.dtype)
                out = torch.load(Path(work) / "out.pt")
                row["equal"] = bool(torch.allclose(out.float(), reference.float(), **tolerance))
                row["status"] = "ok"
            except Exception as err:   # noqa: BLE001 - one method failing is a result, reported in the table
                row = {"method": method, "status": f"{type(err).__name__}: {err}"[:200]}
        rows.append(row)
        print(f"diffusion {method}: {row['status']}, {row.get('ms_per_step', '—')} ms/step", file=sys.stderr,
              flush=True)
        gc.collect()
    shutil.rmtree(path, ignore_errors=True)
    return rows


def measure(args, device: Device, workdir: Path, deadline: float) -> tuple[list[dict], dict]:
    target, reason = (int(args.dry_model_mib * 2**20), "dry run") if args.dry_run else model_target_bytes(args)
    info = {"target_bytes": target, "target_reason": reason}
    rows = []
    gen = torch.Generator().manual_seed(0)
    inputs_cpu = {"input_ids": torch.randint(0, 2000, (1, args.tokens), generator=gen)}
    inputs = {k: v.to("cpu" if device.dry_run else "cuda:0") for k, v in inputs_cpu.items()}
    for name in args.models:
        fields = DRY_SHAPES[name] if args.dry_run else SHAPES[name][0]
        config, layers = size_config(fields, target, args.dtype)
        meta = _meta(config, args.dtype)
        total = _bytes(meta)
        path = str(workdir / name)
        if time.time() > deadline:
            rows += [_skipped(name, layers, total, f, m, device) for f in args.budgets for m in METHODS]
            continue
        start = time.perf_counter()
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device("cpu" if device.dry_run else "cuda:0"):  # random init on the GPU: seconds, not minutes
            AutoModelForCausalLM.from_config(config, dtype=args.dtype).save_pretrained(path)
        device.reset()
        print(f"{name}: {total / 2**30:.2f} GiB, {layers} layers, built and saved in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        for i, f in enumerate(args.budgets):
            budget = device.budget(f, total)
            problem = allocator.build_problem(meta, dict(budget))
            try:
                plan, no_plan = allocator.plan(meta, dict(budget)), None
            except allocator.InfeasiblePlacement as err:  # possible in a dry run: the CPU main must hold lm_head
                plan, no_plan = None, f"no plan: needs {err.minimum} B on {err.device!r}"
            order = METHODS if i % 2 == 0 else METHODS[::-1]
            for method in order:
                if time.time() > deadline:
                    rows.append(_skipped(name, layers, total, f, method, device))
                    continue
                if method == "ours" and plan is None:
                    rows.append(_row(name, layers, total, f, method, budget, problem, None, dict(
                        status=no_plan, device_map=None, times=[], after_load=None, peak=None), device))
                    continue
                with tempfile.TemporaryDirectory(dir=workdir) as offload:
                    result = run_load(path, "auto" if method == "auto" else plan.device_map, budget, device,
                                      inputs, args, offload)
                rows.append(_row(name, layers, total, f, method, budget, problem, plan, result, device))
                print(f"{name} {f:.0%} {method}: {rows[-1]['status']}, {rows[-1]['median_ms'] or '—'} ms",
                      file=sys.stderr, flush=True)
        if args.runtime_budget:
            info.setdefault("runtime", []).extend(
                measure_runtime(args, device, workdir, name, total, meta, path, inputs, deadline))
        if args.hybrid_budget and name == args.models[0] and time.time() < deadline:
            info.setdefault("hybrid", []).extend(dict(model=name, budget=args.hybrid_budget, **row) for row in
                                                 hybrid_case(path, meta, total, args.hybrid_budget, workdir,
                                                             dry_run=device.dry_run, tokens=args.hybrid_tokens))
        if args.gen_budget:
            info.setdefault("generate", []).extend(
                measure_generate(args, device, workdir, name, layers, total, meta, path, deadline))
        shutil.rmtree(path, ignore_errors=True)
    return rows, info


def _skipped(name, layers, total, f, method, device) -> dict:
    row = _row(name, layers, total, f, method, device.budget(f, total), None, None,
               dict(status="skipped: time limit", device_map=None, times=[], after_load=None, peak=None), device)
    return row


def _row(name, layers, total, f, method, budget, problem, plan, result, device) -> dict:
    key = device.key
    device_map = result["device_map"]
    resident = predicted = valid = ""
    if problem is not None and device_map:
        g = problem.graph
        resident = sum(t.counted for t, d in zip(g.tensors, tensor_devices(g, device_map)) if d == key)
        violations, memory = check(problem, device_map)
        predicted, valid = memory.peak.get(key, 0), not violations
    times = result["times"]
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    return dict(
        model=name, layers=layers, model_bytes=total, budget=f"{f:.2f}", device_budget_bytes=budget[key],
        method=method, strategy=(plan.strategy if plan else "") if method == "ours" else "transformers-auto",
        status=result["status"], matches_plan=(device_map == plan.device_map) if method == "ours" and plan and
        device_map else "", resident_device_bytes=resident, predicted_peak_bytes=predicted, valid=valid,
        measured_peak_bytes="" if result["peak"] is None else result["peak"],
        after_load_bytes="" if result["after_load"] is None else result["after_load"],
        within_budget="" if result["peak"] is None else result["peak"] <= budget[key],
        n=len(times), median_ms=f"{statistics.median(times) * 1e3:.2f}" if times else "",
        q1_ms=f"{q[0] * 1e3:.2f}" if times else "", q3_ms=f"{q[2] * 1e3:.2f}" if times else "",
    )


# --------------------------------------------------------------------------------------------------------------
# Report.

def table(rows, dry_run: bool) -> str:
    unit = "MiB" if dry_run else "GiB"
    scale = 2**20 if dry_run else 2**30

    def size(n):
        return "—" if n == "" else f"{int(n) / scale:.2f}"

    by = {(r["model"], r["budget"], r["method"]): r for r in rows}
    cells = list(dict.fromkeys((r["model"], r["budget"]) for r in rows))
    lines = [f"| model | budget | on device, auto → ours ({unit}) | auto ms [IQR] | ours ms [IQR] | auto / ours | "
             f"peak measured / predicted, auto ({unit}) | peak measured / predicted, ours ({unit}) | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, budget in cells:
        a, o = by[model, budget, "auto"], by[model, budget, "ours"]

        def lat(r):
            return f"{r['median_ms']} [{r['q1_ms']}–{r['q3_ms']}]" if r["median_ms"] else "—"

        both = a["median_ms"] and o["median_ms"]
        ratio = f"**{float(a['median_ms']) / float(o['median_ms']):.2f}×**" if both else "—"
        status = "ok" if a["status"] == o["status"] == "ok" else f"auto: {a['status']}; ours: {o['status']}"
        over = {m: " (over budget)" if r["within_budget"] is False else "" for m, r in (("a", a), ("o", o))}
        lines.append(
            f"| {model} ({size(a['model_bytes'])} {unit}, {a['layers']} layers) | {float(budget):.0%} = "
            f"{size(a['device_budget_bytes'])} | {size(a['resident_device_bytes'])} → "
            f"{size(o['resident_device_bytes'])} | "
            f"{lat(a)} | {lat(o)} | {ratio} | {size(a['measured_peak_bytes'])} / {size(a['predicted_peak_bytes'])}"
            f"{over['a']} | {size(o['measured_peak_bytes'])} / {size(o['predicted_peak_bytes'])}{over['o']} | "
            f"{status} |")
    return "\n".join(lines)


def generate_table(rows, dry_run: bool) -> str:
    unit, scale = ("MiB", 2**20) if dry_run else ("GiB", 2**30)

    def size(n):
        return "—" if n == "" else f"{int(n) / scale:.3f}"

    lines = [f"| model | budget ({unit}) | method | on device ({unit}) | peak measured / predicted ({unit}) | "
             "within budget | generate s | status |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        within = "" if r["within_budget"] == "" else ("yes" if r["within_budget"] else "**no**")
        lines.append(f"| {r['model']} | {float(r['budget']):.0%} = {size(r['device_budget_bytes'])} | {r['method']} | "
                     f"{size(r['resident_device_bytes'])} | {size(r['measured_peak_bytes'])} / "
                     f"{size(r['predicted_peak_bytes'])} | {within} | {r['generate_s'] or '—'} | {r['status']} |")
    return "\n".join(lines)


def report(rows, info, args, device: Device, command, seconds) -> str:
    ok = [(a, o) for a in rows for o in rows if a["method"] == "auto" and o["method"] == "ours"
          and (a["model"], a["budget"]) == (o["model"], o["budget"]) and a["median_ms"] and o["median_ms"]]
    wins = sum(1 for a, o in ok if float(o["median_ms"]) < float(a["median_ms"]))
    differ = [(a, o) for a, o in ok if a["resident_device_bytes"] != o["resident_device_bytes"]]
    wins_differ = sum(1 for a, o in differ if float(o["median_ms"]) < float(a["median_ms"]))
    cuda = "" if device.dry_run else f", CUDA {torch.version.cuda}"
    parts = [
        "# GPU benchmark: our plan vs transformers `device_map=\"auto\"`" + (" — DRY RUN (CPU, tiny models)" if
                                                                            args.dry_run else "") + "\n",
        f"`{command}` — {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {seconds:.0f} s. Device: "
        f"{device.name}; {os.cpu_count()} CPU cores; torch {torch.__version__}{cuda}, transformers "
        f"{importlib.metadata.version('transformers')}, accelerate {importlib.metadata.version('accelerate')}; "
        f"{str(args.dtype).removeprefix('torch.')}.\n",
        f"Models of about {info['target_bytes'] / 2**30:.2f} GiB ({info['target_reason']}). Budgets: "
        + ("`{'cpu': f * total}` — the CPU is the main device, the rest is on disk (dry run). " if args.dry_run else
           "`{0: f * total, 'cpu': 2 * total}`. ")
        + f"{args.warmup} warm-up and {args.forwards} timed forwards per load, batch 1, {args.tokens} tokens. "
        "*Peak measured*: `torch.cuda.max_memory_allocated` during the timed forwards minus what was allocated "
        "before loading; *predicted*: the peak `allocator` computes for the map under accelerate's rules.\n",
        table(rows, args.dry_run), "",
        f"Ours faster by the median in {wins}/{len(ok)} measured cells; where the maps keep different bytes on the "
        f"device: {wins_differ}/{len(differ)}.",
    ]
    if info.get("generate"):
        g = generation_budget(args)
        parts.append(
            f"\n## generate: batch {g.batch_size}, {g.prompt_length}-token prompt, {args.gen_new} new tokens\n\n"
            "Predicted: the peak `allocator` computes for the map with this generation budget (weights + KV cache + "
            "logits + activations); ours is planned with it, auto is not.\n\n" + generate_table(info["generate"],
                                                                                             args.dry_run))
    if info.get("runtime"):
        parts.append(
            "\n## offload runtime: accelerate's hooks against `allocator.offload`, budget "
            f"{args.runtime_budget:.0%}\n\n"
            "One map planned with `runtime=\"allocator\", prefetch=1`, loaded once per runtime; forwards take turns. "
            + ("Dry run: the CPU is main, offloaded weights come from disk; `ours-1-standin` runs the GPU stream "
               "scheduling (side-stream copies, events) with the CPU stand-in device." if args.dry_run else
               "Ours copies from pinned host memory on a side CUDA stream, the compute stream waiting on an event.")
            + "\n\n" + runtime_table(info["runtime"]))
    if info.get("moe"):
        keys = list(dict.fromkeys(k for r in info["moe"] for k in r))
        parts.append(f"\n## mixture of experts: Qwen3-MoE shape (64 experts, top-4), device budget "
                     f"{args.moe_budget:.0%}\n\n`device_map=\"auto\"` (accelerate's hooks) against "
                     "`plan(runtime=\"allocator\")` + `allocator.offload.attach` (experts as units; only routed "
                     "experts move). Greedy decode with a KV cache, ms per token (median).\n\n"
                     + "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
                     + "\n".join("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in info["moe"]))
    if info.get("hybrid"):
        keys = list(dict.fromkeys(k for r in info["hybrid"] for k in r))
        parts.append(f"\n## hybrid execution (issue #40): streamed vs computed where the weights live, GPU budget "
                     f"{args.hybrid_budget:.0%}\n\nOne plan with `runtime=\"allocator\"` and a generation budget, run "
                     "with its compute map (`hybrid`), without it (`stream`), and with each offloaded decoder layer "
                     "split (`split`: attention and KV cache on the GPU, the MLP in RAM; issue #49); greedy decode "
                     "with a KV cache. "
                     + ("Dry run: the stand-in is the accelerator; times are CPU times, not a GPU's." if args.dry_run
                        else "Measured on this GPU.") + "\n\n"
                     + "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
                     + "\n".join("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in info["hybrid"]))
    if info.get("diffusion"):
        keys = list(dict.fromkeys(k for r in info["diffusion"] for k in r))
        parts.append(f"\n## diffusion: one denoising step of a Flux-shaped transformer, device budget "
                     f"{args.diffusion_budget:.0%}\n\ndiffusers' `device_map=\"auto\"`, diffusers' group offloading "
                     "(block level), allocator's plan under accelerate's hooks and under the allocator runtime "
                     f"(`python benchmarks/diffusion.py` is the CPU/disk version).\n\n"
                     + "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
                     + "\n".join("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |"
                                 for r in info["diffusion"]))
    if info.get("pipeline"):
        parts.append(gpu_pipelines.section(
            "diffusion pipeline (issue #47): ours under `patch(runtime=\"allocator\")` against model and group "
            "offloading", info["pipeline"], "`benchmarks/gpu_pipelines.py` says what runs and how bytes are counted. "
            + ("Dry run: the stand-in is the accelerator; times are CPU times, not a GPU's." if args.dry_run else
               "Measured on this GPU.")))
    if info.get("assisted"):
        parts.append(gpu_pipelines.section(
            "assisted generation (issue #47): target and draft loaded in one `patch()` block", info["assisted"],
            "The draft is loaded without `max_memory`: it plans in what the target left. "
            + ("Dry run: RAM budget for the target, the rest on disk, the stand-in as the runtime's device; CPU "
               "times." if args.dry_run else "Measured on this GPU.")))
    skipped = [r for r in rows if r["status"].startswith("skipped")]
    if skipped:
        parts.append(f"\n{len(skipped)} loads skipped at the {args.time_limit:.0f} s time limit.")
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU (no accelerator needed)")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS), help="fractions of the model")
    parser.add_argument("--model-gib", type=float, default=3.0, help="target size of each model (GiB)")
    parser.add_argument("--dry-model-mib", type=float, default=2.0, help="target size in a dry run (MiB)")
    parser.add_argument("--forwards", type=int, help="timed forwards per load (default 20; 3 in a dry run)")
    parser.add_argument("--warmup", type=int, help="untimed forwards per load (default 3; 1 in a dry run)")
    parser.add_argument("--tokens", type=int, default=32, help="input length (batch 1)")
    parser.add_argument("--gen-budget", type=float, default=0.7,
                        help="generate case: the device budget as a fraction of the model (0 skips the case)")
    parser.add_argument("--gen-batch", type=int, help="generate case: batch size (default 8; 2 in a dry run)")
    parser.add_argument("--gen-length", type=int, help="generate case: prompt + new tokens (default 2048; 32 dry)")
    parser.add_argument("--gen-new", type=int, help="generate case: new tokens (default 16; 4 in a dry run)")
    parser.add_argument("--runtime-budget", type=float, default=0.5,
                        help="runtime case: the device budget as a fraction of the model (0 skips the case)")
    parser.add_argument("--hybrid-budget", type=float, default=0.4,
                        help="hybrid case (issue #40): GPU budget as a fraction of the first model, streamed vs "
                             "computed where the weights live at decode (0 skips the case)")
    parser.add_argument("--hybrid-tokens", type=int, default=16, help="hybrid case: tokens decoded")
    parser.add_argument("--moe-budget", type=float, default=0.3,
                        help="MoE case: the device budget as a fraction of the model (0 skips the case)")
    parser.add_argument("--moe-tokens", type=int, default=16, help="MoE case: tokens decoded")
    parser.add_argument("--diffusion-budget", type=float, default=0.5,
                        help="diffusion case: the device budget as a fraction of the model (0 skips the case)")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the diffusion pipeline case (issue #47)")
    parser.add_argument("--no-assisted", action="store_true", help="skip the assisted-generation case (issue #47)")
    parser.add_argument("--time-limit", type=float, default=420.0,
                        help="seconds after which remaining loads are skipped (default 420: done within 8 minutes)")
    parser.add_argument("--workdir", type=Path, help="where models are saved (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: benchmarks/results)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; run on a machine with a GPU, or pass --dry-run")
    args.forwards = args.forwards or (3 if args.dry_run else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    args.dtype = torch.float32 if args.dry_run else torch.bfloat16
    args.gen_batch = args.gen_batch or (2 if args.dry_run else 8)
    args.gen_length = args.gen_length or (32 if args.dry_run else 2048)
    args.gen_new = args.gen_new or (4 if args.dry_run else 16)
    start = time.time()
    if args.dry_run:
        torch.set_num_threads(1)  # tiny matmuls: more threads only spin on a shared machine
    quiet()
    device = Device(args.dry_run)
    command = " ".join(["python benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        rows, info = measure(args, device, Path(tmp), start + args.time_limit)
        if args.moe_budget:
            info["moe"] = measure_moe(args, device, Path(tmp), start + args.time_limit)
        if args.diffusion_budget and importlib.util.find_spec("diffusers"):
            info["diffusion"] = measure_diffusion(args, device, Path(tmp), start + args.time_limit)
        for case, skip, measure_case in (("pipeline", args.no_pipeline, gpu_pipelines.measure_pipeline),
                                    ("assisted", args.no_assisted, gpu_pipelines.measure_assisted)):
            if skip or (case == "pipeline" and not importlib.util.find_spec("diffusers")):
                continue
            info[case] = (gpu_pipelines.guarded(measure_case, args, args.dry_run, Path(tmp))
                          if time.time() < start + args.time_limit else [{"status": "skipped (time limit)"}])
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "gpu.csv", rows)
    if info.get("generate"):
        write_csv(args.out / "gpu_generate.csv", info["generate"])
    if info.get("runtime"):
        write_csv(args.out / "gpu_runtime.csv", info["runtime"])
    if info.get("hybrid"):
        keys = list(dict.fromkeys(k for r in info["hybrid"] for k in r))
        write_csv(args.out / "gpu_hybrid.csv", [{k: r.get(k, "") for k in keys} for r in info["hybrid"]])
    if info.get("moe"):
        keys = list(dict.fromkeys(k for r in info["moe"] for k in r))
        write_csv(args.out / "gpu_moe.csv", [{k: r.get(k, "") for k in keys} for r in info["moe"]])
    if info.get("diffusion"):
        keys = list(dict.fromkeys(k for r in info["diffusion"] for k in r))
        write_csv(args.out / "gpu_diffusion.csv", [{k: r.get(k, "") for k in keys} for r in info["diffusion"]])
    for case in ("pipeline", "assisted"):
        if info.get(case):
            keys = list(dict.fromkeys(k for r in info[case] for k in r))
            write_csv(args.out / f"gpu_{case}.csv", [{k: r.get(k, "") for k in keys} for r in info[case]])
    text = report(rows, info, args, device, command, time.time() - start)
    (args.out / "gpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
