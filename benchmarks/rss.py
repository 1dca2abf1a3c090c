"""What RSS shows for a model whose experts are memory-mapped: anonymous and file-backed, by load path, and what comes
back after ``detach`` and ``del`` (issue 48).

Each row runs in a fresh process (``--child``): a Qwen3-MoE shape (``benchmarks/moe.py``'s, 64 experts top-4) saved
once, everything imported and warmed once (a load in RAM and ``generate``, a plan, ``patch()`` entered: one-time
imports are not what a load holds), glibc's heap trimmed, then ``RssAnon`` and ``RssFile`` of ``/proc/self/status``
read before the load, after it, after a greedy ``generate``, and after ``detach`` (where attached), ``del`` and
``gc.collect()``. Paths, at ``--ram`` of the model's bytes as RAM budget on a CPU main device:

- ``ram``: the model fully in RAM (no map);
- ``transformers``: ``from_pretrained(device_map="auto", max_memory=...)`` unpatched (accelerate's hooks);
- ``patch``: the same inside ``allocator.patch(runtime="allocator")`` (the plan made in ``from_pretrained``, the
  runtime attached);
- ``plan-attach``: ``from_pretrained(device_map=plan.device_map)`` then ``allocator.offload.attach(model, plan)``;

``allocator.offload.dispatch`` (accelerate's ``load_checkpoint_and_dispatch``) is not a row: with the plan's map on
this transformers 5 checkpoint, accelerate's ``offload_weight`` meets a meta tensor (``NotImplementedError: Cannot
copy out of meta tensor``) while writing the offload folder, before our runtime is attached (not investigated).

    python benchmarks/rss.py            # the Qwen3 shape of benchmarks/moe.py
    python benchmarks/rss.py --smoke    # a small shape (CI smoke)

Writes ``results/rss.csv`` and ``results/rss.md`` (``--out`` for another folder). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results"
PATHS = ("ram", "transformers", "patch", "plan-attach")
MIB = 2 ** 20


def _rss() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}


def child(path: str, smoke: bool, ram: float) -> dict:
    """One row, in this (fresh) process."""
    import torch

    torch.set_num_threads(1)
    import allocator
    from allocator import offload
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    import moe
    from benchutil import quiet

    quiet()
    family, fields = (moe.SMOKE if smoke else moe.SHAPES)["qwen3-moe"]
    folder = Path(tempfile.mkdtemp()) / "m"
    config = moe.build_config(family, fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    budget = {"cpu": int(ram * allocator.build_problem(meta, {"cpu": 0}).graph.total)}
    prompt = torch.randint(0, moe.VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    moe._load(folder).generate(prompt, max_new_tokens=3, do_sample=False)
    plan = allocator.plan(meta, budget, runtime="allocator")
    with allocator.patch(runtime="allocator"):
        pass
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    off = folder.parent / "off"
    out = {"before": _rss()}
    if path == "ram":
        model = moe._load(folder)
    elif path == "transformers":
        model = moe._load(folder, "auto", off, max_memory=budget)
    elif path == "patch":
        model = moe._patched(folder, off, budget)[0]
    else:
        model = moe._attached(folder, off, plan)[0]
    out["loaded"] = _rss()
    model.generate(prompt, max_new_tokens=3, do_sample=False)
    out["generated"] = _rss()
    if offload.runtime_of(model) is not None:
        offload.detach(model)
    del model
    gc.collect()
    out["after"] = _rss()
    out["model_mib"] = round(allocator.build_problem(meta, {"cpu": 0}).graph.total / MIB, 1)
    out["budget_mib"] = round(budget["cpu"] / MIB, 1)
    return out


def row(path: str, data: dict) -> dict:
    r = {"path": path, "model_mib": data["model_mib"], "ram_budget_mib": data["budget_mib"]}
    for stage in ("loaded", "generated", "after"):
        for kind, key in (("anon", "RssAnon"), ("file", "RssFile")):
            r[f"{stage}_{kind}_mib"] = round((data[stage][key] - data["before"][key]) / MIB, 1)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--ram", type=float, default=0.3, help="RAM budget as a share of the model's bytes")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.smoke, args.ram)))
        return 0
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.time()
    rows = []
    for path in args.paths:
        proc = subprocess.run([sys.executable, __file__, "--child", path, "--ram", str(args.ram),
                               *(["--smoke"] if args.smoke else [])], capture_output=True, text=True, check=True)
        rows.append(row(path, json.loads(proc.stdout.strip().splitlines()[-1])))
    sys.path.insert(0, str(Path(__file__).parent))
    from benchutil import cores, write_csv

    command = "python benchmarks/rss.py " + " ".join(argv if argv is not None else sys.argv[1:])
    keys = list(rows[0])
    lines = [f"`{command.strip()}`, {started}, {time.time() - t0:.0f} s, {cores()}. MiB above the same process "
             "before the load (heap trimmed then): anonymous (`RssAnon`) and file-backed (`RssFile`) resident "
             "memory, after the load, after `generate`, after `detach` (where attached), `del` and `gc.collect()`.",
             "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "rss.csv", rows)
    (args.out / "rss.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
