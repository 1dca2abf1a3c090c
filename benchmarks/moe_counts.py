"""What a decoded token costs beyond the model in RAM, counted so that a loaded machine does not change the answer
(issue #48): the Qwen3-MoE shape of ``benchmarks/moe.py`` at 30 % RAM through ``patch(runtime="allocator")``, against
the same model in RAM (both ``experts_implementation="eager"``), one torch thread.

Per decoded token (the steps after the prompt's, greedy, KV cache), for each row:

- ``aten_ops``: aten operators dispatched (a ``TorchDispatchMode`` that counts);
- ``python_calls``: Python function calls (``cProfile``'s count);
- ``madvise``, ``mincore``: the runtime's read-ahead requests (``MappedFile.advise``) and page questions
  (:class:`allocator.offload.expert_pages.Residency`; absent in code before it);
- ``send_to_device``: accelerate's walks over arguments;
- ``minor_faults``: ``getrusage`` page faults of the process;
- ``cpu_ms``: CPU seconds of the process (``time.process_time``, one thread), the median of ``--rounds`` interleaved
  rounds, and ``cpu_vs_ram`` the median of the per-round ratios (ours over RAM in the same round).

Counts are exact and repeat from run to run; ``cpu_ms`` still moves with the load (caches shared with other processes).

    python benchmarks/moe_counts.py                 # 24 tokens, 9 rounds
    PYTHONPATH=<another checkout> python benchmarks/moe_counts.py   # the same script on other code
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
import moe  # noqa: E402
from benchutil import quiet  # noqa: E402


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Calls:
    """Counts calls of ``owner.name`` while installed."""

    def __init__(self, owner, name):
        self.owner, self.name, self.count = owner, name, 0
        self.original = getattr(owner, name)

    def __enter__(self):
        def counted(*a, **k):
            self.count += 1
            return self.original(*a, **k)

        setattr(self.owner, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.original)


def _steps(model, prompt, tokens: int, around=None) -> tuple[list[int], float]:
    """Greedy tokens of ``tokens`` decode steps after the prompt's, and CPU seconds of those steps;
    ``around`` (a context manager factory) wraps each decode step."""
    from transformers import DynamicCache

    from allocator.model.cache_kwarg import cache_keyword

    keyword, out = cache_keyword(model), []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids = model(input_ids=prompt, **{keyword: cache}, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.process_time()
        for _ in range(tokens):
            if around is None:
                logits = model(input_ids=ids, **{keyword: cache}, use_cache=True).logits
            else:
                with around():
                    logits = model(input_ids=ids, **{keyword: cache}, use_cache=True).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
    return out, time.process_time() - t0


def counts(model, prompt, tokens: int) -> dict:
    """The per-token counts of one row (module docstring)."""
    import accelerate.utils

    from allocator.offload import files

    mincore = _mincore_calls(model)   # first, at full speed (the slower passes below stretch time)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    with _Calls(files.MappedFile, "advise") as advise, _Calls(accelerate.utils, "send_to_device") as send:
        _steps(model, prompt, tokens)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    row = dict(madvise=advise.count / tokens, send_to_device=send.count / tokens,
               mincore=(_mincore_calls(model) - mincore) / tokens if mincore is not None else "",
               minor_faults=(r1.ru_minflt - r0.ru_minflt) / tokens)
    ops = _Ops()
    _steps(model, prompt, tokens, around=lambda: ops)
    row["aten_ops"] = ops.count / tokens
    profile = cProfile.Profile()
    _steps(model, prompt, tokens, around=lambda: _Profiled(profile))
    row["python_calls"] = pstats.Stats(profile).total_calls / tokens
    return row


class _Profiled:
    def __init__(self, profile):
        self.profile = profile

    def __enter__(self):
        self.profile.enable()

    def __exit__(self, *exc):
        self.profile.disable()


def _mincore_calls(model):
    from allocator.offload import runtime_of

    runtime = runtime_of(model)
    routed = next(iter(runtime.experts.values()), None) if runtime is not None else None
    pages = getattr(routed, "pages", None)
    return pages.calls if pages is not None else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    family, fields = moe.SHAPES["qwen3-moe"]
    options = argparse.Namespace(ram=0.3, prompt=32, tokens=12)
    with tempfile.TemporaryDirectory() as work:
        folder, ref, _, _, budget, prompt = moe._saved("qwen3-moe", family, fields, options, Path(work))
        models = {"ram": ref, "ours-patch": moe._patched(folder, Path(work) / "off", budget)[0]}
        want = _steps(ref, prompt, args.tokens)[0]
        rows = {name: dict(row=name, tokens_equal=_steps(m, prompt, args.tokens)[0] == want)
                for name, m in models.items()}
        for name, m in models.items():
            rows[name].update(counts(m, prompt, args.tokens))
        seconds: dict = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, m in models.items():
                seconds[name].append(_steps(m, prompt, args.tokens)[1] / args.tokens)
    for name in models:
        rows[name]["cpu_ms"] = round(statistics.median(seconds[name]) * 1e3, 3)
        rows[name]["cpu_vs_ram"] = round(statistics.median(a / b for a, b in zip(seconds[name], seconds["ram"])), 3)
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows.values():
        print("| " + " | ".join(str(round(v, 2) if isinstance(v, float) else v) for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
