"""What a prefill forward really allocates beyond the weights, against the activation term of ``generate``'s budget.

A tiny qwen3 (2 layers, hidden 128, 4 query and 2 key/value heads of dim 32, MLP 384, vocab 1000) is built from its
config on the CPU and run as ``generate`` runs its prefill: ``model(input_ids, attention_mask, cache=DynamicCache(
config=...), logits_to_keep=1)``. Every CPU allocation is traced by the torch profiler (``profile_memory=True``); the
peak of the running sum of allocations and frees during the forward, less the KV cache held at its end and the
logits, is the activations measured. A ``TorchDispatchMode`` run of the same forward names the ``batch x 1 x tokens x
tokens`` allocations (the 4-D masks) and the ``batch x heads x tokens x tokens`` ones (the scores): which op, which
dtype. The prediction is :func:`allocator.model.generation.generation_needs`' ``activations`` for the same batch,
prompt and dtype.

Run ``python benchmarks/prefill_memory.py`` (``--lengths 256 1024 4096 --attn sdpa eager --dtype float32 bfloat16``,
``--batch 2 --pad 10`` for a padded batch, ``--window 128`` for a sliding layer before the full one). Prints one
line per case: measured, predicted, their ratio, and the square allocations.
"""

from __future__ import annotations

import argparse
import logging
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import allocator

__all__ = ["measure", "tiny_qwen3"]


def tiny_qwen3(attn: str, dtype: torch.dtype = torch.float32, window: int | None = None):
    """The tiny qwen3 of the module notes, random weights (seed 0), in eval mode; ``window`` makes its first layer a
    sliding-window one."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    extra = (dict(sliding_window=window, use_sliding_window=True, max_window_layers=0,
                  layer_types=["sliding_attention", "full_attention"]) if window else {})
    config = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=1000, max_position_embeddings=8192,
                         attn_implementation=attn, **extra)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(dtype).eval()


class _Squares(TorchDispatchMode):
    """Names the new tensors (not views) whose last two dimensions are ``tokens x tokens``: op, dtype, shape."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.found, self.seen = tokens, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.ndim >= 2 and tuple(t.shape[-2:]) == (self.tokens, self.tokens)
                    and t.untyped_storage().data_ptr() not in self.seen):
                self.seen.add(t.untyped_storage().data_ptr())
                self.found.append(f"{func.__name__.split('.')[0]} {str(t.dtype).removeprefix('torch.')} "
                                  f"{'x'.join(map(str, t.shape))}")
        return out


def profiled_peak(run) -> int:
    """The peak of the running sum of CPU allocations and frees while ``run()`` runs (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def measure(attn: str, tokens: int, dtype: torch.dtype = torch.float32, *, batch: int = 1, pad: int = 0,
            window: int | None = None) -> dict:
    """One prefill of ``batch x tokens`` (the first sequence's first ``pad`` positions padding) through the tiny qwen3
    under ``attn``: the activations measured and predicted (bytes), and the square allocations named."""
    from transformers import DynamicCache

    model = tiny_qwen3(attn, dtype, window)
    ids = torch.randint(3, 1000, (batch, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[0, :pad] = 0
    held: dict = {}

    def run():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
        held["cache"] = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
        held["logits"] = out.logits.untyped_storage().nbytes()
        held["out"] = weakref.ref(out.logits)

    peak = profiled_peak(run)
    squares = _Squares(tokens)
    with squares:
        run()
    budget = allocator.GenerationBudget(batch, tokens + 1, dtype, prompt_length=tokens)
    needs = allocator.build_problem(model, {"cpu": 10**12}, generation=budget).generation
    measured = peak - held["cache"] - held["logits"]
    return dict(attn=attn, dtype=str(dtype).removeprefix("torch."), batch=batch, pad=pad, window=window,
                tokens=tokens, peak=peak, cache=held["cache"], measured=measured, predicted=needs.activations,
                ratio=needs.activations / measured, squares=list(dict.fromkeys(squares.found)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--attn", nargs="+", default=["sdpa", "eager"])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pad", type=int, default=0)
    ap.add_argument("--window", type=int, default=None)
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    print("attn   dtype     batch pad window tokens    measured B   predicted B  pred/meas  square allocations")
    for attn in args.attn:
        for dtype in args.dtype:
            for tokens in args.lengths:
                r = measure(attn, tokens, getattr(torch, dtype), batch=args.batch, pad=args.pad, window=args.window)
                print(f"{attn:6} {r['dtype']:9} {r['batch']:5} {r['pad']:3} {str(r['window']):6} {tokens:6} "
                      f"{r['measured']:13,} {r['predicted']:13,} {r['ratio']:10.3f}  {'; '.join(r['squares'])}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
