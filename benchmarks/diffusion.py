"""One denoising step of a small random Flux-shaped transformer with part of it on disk: diffusers' own
``device_map="auto"`` load, diffusers' group offloading (block level, ``offload_to_disk_path``) and allocator's plan
with the allocator runtime (``allocator.patch(runtime="allocator")`` around the same ``from_pretrained``).

(The file is not named ``diffusers.py``: run as a script, its folder comes first on ``sys.path`` and a module of that
name would shadow the diffusers package.)

The model (``FluxTransformer2DModel``, random, float32) is saved once with ``save_pretrained`` (safetensors). Each
method runs in a fresh process (so that its peak RSS is its own) on the CPU as the main device:

- ``diffusers-auto``: ``from_pretrained(device_map="auto", max_memory={"cpu": f * model}, offload_folder=...)``,
  unpatched: accelerate's hooks over diffusers' own map;
- ``group-offload``: ``from_pretrained()`` into RAM, then ``enable_group_offload(onload_device="cpu",
  offload_type="block_level", num_blocks_per_group=1, offload_to_disk_path=...)``: every block group lives on disk
  and is read at each step;
- ``allocator-plan``: the same ``from_pretrained`` under ``allocator.patch()`` (allocator's map, accelerate's hooks);
- ``allocator``: under ``allocator.patch(runtime="allocator")`` (allocator's map, the allocator runtime).

Per method: median ms per step over ``--steps`` steps after one warm-up (batch 1; the page cache is warm, so disk
reads are page-cache reads), ``/proc/self/io`` ``rchar`` and ``read_bytes`` per step, minor page faults per step ×
4 KiB (safetensors maps its files, so reads through the map are counted as faults, not by ``rchar``), the bytes the
map puts on disk, and the child's peak RSS (``ru_maxrss``, load included). Each method's output is compared with the
model in RAM (``torch.testing.assert_close``, rtol 1e-4, atol 1e-5).

    python benchmarks/diffusion.py                  # a few minutes on 2 shared cores (5 under load 12)
    python benchmarks/diffusion.py --smoke --steps 1   # a tiny model, for the smoke test
    python benchmarks/diffusion.py --ram 0.3 --steps 10
    python benchmarks/diffusion.py --pipeline          # a whole pipeline, ours against model and group offloading
    python benchmarks/diffusion.py --pipeline --smoke --rounds 1

``--pipeline`` is :mod:`diffusion_pipeline` (its docstring says what it runs and counts): a small random FluxPipeline
on one budget with the stand-in as the accelerator, into ``diffusion_pipeline.md`` / ``.csv``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchutil import write_csv

OUT = Path(__file__).parent / "results"
METHODS = ("diffusers-auto", "group-offload", "allocator-plan", "allocator")
FLUX = dict(patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=64,
            num_attention_heads=6, joint_attention_dim=384, pooled_projection_dim=384, axes_dims_rope=[16, 24, 24])
"""A Flux-shaped transformer (4 double-stream and 8 single-stream blocks, 384 wide): about 100 MiB in float32."""
SMOKE = dict(FLUX, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, pooled_projection_dim=32, in_channels=4, axes_dims_rope=[4, 4, 8])
"""``--smoke``: a tiny one (1 + 2 blocks), for the smoke test."""
IMAGE_TOKENS, TEXT_TOKENS = 256, 64


def inputs(fields: dict = FLUX, device="cpu", dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(1)
    found = dict(hidden_states=torch.randn(1, IMAGE_TOKENS, fields["in_channels"], generator=g),
                 encoder_hidden_states=torch.randn(1, TEXT_TOKENS, fields["joint_attention_dim"], generator=g),
                 pooled_projections=torch.randn(1, fields["pooled_projection_dim"], generator=g),
                 timestep=torch.tensor([0.5]), img_ids=torch.zeros(IMAGE_TOKENS, 3),
                 txt_ids=torch.zeros(TEXT_TOKENS, 3))
    return {**{k: v.to(device, dtype if k not in ("img_ids", "txt_ids") else torch.float32)
               for k, v in found.items()}, "return_dict": False}


def build(path: Path, fields: dict = FLUX, device="cpu", dtype=torch.float32) -> int:
    """Save the random model to ``path`` (and its bytes to ``path/bytes``); its output where it is built to
    ``path/reference.pt``; return its bytes."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = FluxTransformer2DModel(**fields).eval()
    if dtype != torch.float32:
        model = model.to(dtype)
    model.save_pretrained(path)
    with torch.no_grad():
        torch.save(model(**inputs(fields, device, dtype))[0].cpu(), path / "reference.pt")
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    (path / "bytes").write_text(str(total))
    (path / "fields.json").write_text(json.dumps(fields))
    return total


def _io() -> dict:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"]),
            "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}


def _disk_bytes(model, device_map: dict | None) -> int | None:
    if not device_map:
        return None
    total = 0
    for name, tensor in model.state_dict().items():
        key = name
        while key not in device_map and key:
            key = key.rpartition(".")[0]
        if device_map.get(key, device_map.get("")) == "disk":
            total += tensor.numel() * tensor.element_size()
    return total


def one(method: str, path: Path, ram: float, steps: int, work: Path, *, device="cpu", fields: dict | None = None,
        dtype=torch.float32) -> dict:
    """Load with ``method``, run ``steps`` timed steps after one warm-up; what it measured (in this process).

    ``device="cpu"``: RAM budget ``ram`` of the model, the rest on disk (group offloading: to disk). A CUDA device:
    a budget of ``ram`` of the model on it and RAM for the rest (group offloading: RAM, with CUDA streams)."""
    import contextlib

    from diffusers import FluxTransformer2DModel

    import allocator

    total = int((path / "bytes").read_text())
    fields = fields or json.loads((path / "fields.json").read_text())
    gpu = device != "cpu"
    budget = ({0: f"{ram * total / 2**20:.3f}MiB", "cpu": f"{4 * total / 2**20:.3f}MiB"} if gpu
              else {"cpu": f"{ram * total / 2**20:.3f}MiB"})
    if method == "group-offload":
        model = FluxTransformer2DModel.from_pretrained(path, torch_dtype=dtype).eval()
        model.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=gpu,
                                   offload_to_disk_path=None if gpu else str(work / "groups"))
        device_map = None
    else:
        context = {"diffusers-auto": contextlib.nullcontext, "allocator-plan": allocator.patch,
                   "allocator": lambda: allocator.patch(runtime="allocator")}[method]
        with context():
            model = FluxTransformer2DModel.from_pretrained(path, device_map="auto", max_memory=budget,
                                                           torch_dtype=dtype,
                                                           offload_folder=str(work / "offload")).eval()
        device_map = dict(model.hf_device_map)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    times, before = [], None
    with torch.no_grad():
        out = model(**inputs(fields, device, dtype))[0]   # warm-up
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        before = _io()
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            out = model(**inputs(fields, device, dtype))[0]
            sync()
            times.append(time.perf_counter() - start)
        after = _io()
    torch.save(out.cpu(), work / "out.pt")
    return {"method": method, "ms_per_step": round(statistics.median(times) * 1e3, 2),
            "rchar_per_step": (after["rchar"] - before["rchar"]) // steps,
            "read_bytes_per_step": (after["read_bytes"] - before["read_bytes"]) // steps,
            "fault_kib_per_step": (after["minflt"] - before["minflt"]) * 4 // steps,
            "map_disk_bytes": _disk_bytes(model, device_map),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "gpu_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if gpu else None,
            "runtime": "allocator" if getattr(model, "_allocator_runtime", None) is not None else
                       ("group offloading" if method == "group-offload" else "accelerate hooks")}


def table(rows: list[dict], total: int, ram: float, header: str, fields: dict) -> str:
    lines = [header, "",
             f"Model: FluxTransformer2DModel {fields['num_layers']}+{fields['num_single_layers']} blocks, "
             f"{total / 2**20:.1f} MiB float32; RAM budget {ram:.0%} of it (`max_memory={{'cpu': ...}}`), the rest "
             "on disk; CPU main device; warm page cache.", "",
             "| method | runtime | ms / step (median) | on disk by the map | rchar / step | read_bytes / step "
             "| page faults × 4 KiB / step | peak RSS (MiB, load included) | output vs RAM |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        disk = "all blocks (group files)" if r["map_disk_bytes"] is None else f"{r['map_disk_bytes'] / 2**20:.1f} MiB"
        lines.append(f"| {r['method']} | {r['runtime']} | {r['ms_per_step']} | {disk} | "
                     f"{r['rchar_per_step'] / 2**20:.1f} MiB | {r['read_bytes_per_step'] / 2**20:.1f} MiB | "
                     f"{r['fault_kib_per_step'] / 1024:.1f} MiB | {r['peak_rss_mib']} | {r['equal']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ram", type=float, default=0.5, help="RAM budget as a fraction of the model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method (after one warm-up)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (1 + 2 blocks): seconds, for the tests")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default: benchmarks/results)")
    parser.add_argument("--pipeline", action="store_true",
                        help="a whole pipeline: ours against enable_model_cpu_offload and group offloading")
    parser.add_argument("--rounds", type=int, default=3, help="--pipeline: interleaved timed rounds")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # internal: run one method in this process
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as work:
            row = one(args.one, args.path, args.ram, args.steps, Path(work))
            out = torch.load(Path(work) / "out.pt")
        reference = torch.load(args.path / "reference.pt")
        try:
            torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
            row["equal"] = "equal (rtol 1e-4, atol 1e-5)"
        except AssertionError as err:
            row["equal"] = "DIFFERS: " + str(err).splitlines()[1 if len(str(err).splitlines()) > 1 else 0]
        print(json.dumps(row))
        return 0
    torch.set_num_threads(1)
    command = " ".join(["python benchmarks/diffusion.py", *(sys.argv[1:] if argv is None else argv)])
    if args.pipeline:
        return _pipeline(args, command)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flux"
        fields = SMOKE if args.smoke else FLUX
        total = build(path, fields)
        rows = []
        for method in args.methods:
            done = subprocess.run([sys.executable, __file__, "--one", method, "--path", str(path), "--ram",
                                   str(args.ram), "--steps", str(args.steps)], capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"})
            if done.returncode:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"{method} failed")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{method}: {rows[-1]['ms_per_step']} ms/step", file=sys.stderr, flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    import diffusers

    header = (f"Measured: `{command}`, {when}, diffusers {diffusers.__version__}, torch {torch.__version__}, "
              f"{os.cpu_count()} cores, load average {load} (1/5/15 min) at the end; one thread per process.")
    text = table(rows, total, args.ram, header, fields)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diffusion.md").write_text(text)
    write_csv(args.out / "diffusion.csv", rows)
    print(text)
    return 0


def _pipeline(args, command: str) -> int:
    import diffusers

    import diffusion_pipeline
    from benchutil import quiet

    quiet()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows, text = diffusion_pipeline.main(args, "")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = (f"Measured: `{command}`, {when}, diffusers {diffusers.__version__}, torch {torch.__version__}, "
              f"{os.cpu_count()} cores, load average {start} at the start and {load} at the end (1/5/15 min: other "
              "sessions ran at the same time); one thread.")
    text = header + text
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diffusion_pipeline.md").write_text(text)
    write_csv(args.out / "diffusion_pipeline.csv", rows)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
