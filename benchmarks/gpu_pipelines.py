"""``benchmarks/gpu.py``'s cases with several models (issue #47): a diffusion pipeline and assisted generation.

- ``pipeline``: :mod:`diffusion_pipeline` on the device: a random FluxPipeline (about 720 MiB in bfloat16 on a GPU,
  :data:`GPU_PIPELINE`; the tiny one in a dry run) on ``{0: 1.1 × the transformer, "cpu": 2 × the pipeline}``, loaded
  under ``allocator.patch(runtime="allocator")`` (``DiffusionPipeline.from_pretrained(device_map="balanced")``), against
  ``enable_model_cpu_offload`` and group offloading (block level, CUDA streams); per method ms per image, bytes moved
  host to device per image (ours on a GPU: the moves only, not what the runtime streams), the GPU's peak, images
  compared with the pipeline whole on the GPU. In a dry run the stand-in is the accelerator, as
  ``benchmarks/diffusion.py --pipeline`` runs it.
- ``assisted``: a llama target and a one-layer draft of the same vocabulary, loaded in one
  ``allocator.patch(runtime="allocator")`` block with ``device_map="auto"``: the target with ``max_memory`` (a
  share of it on the device), the draft without (it plans in what the target left, and the patch says so in a log
  line). Greedy ``generate`` of the target alone and with ``assistant_model=draft``: ms per new token, and whether the
  tokens equal the target alone in RAM (dry run) or whole on the GPU. In a dry run the target's budget is RAM (the
  rest on disk) and the runtime's device is the stand-in.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

GPU_PIPELINE = dict(
    transformer=dict(patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=128,
                     num_attention_heads=8, joint_attention_dim=1024, pooled_projection_dim=768,
                     axes_dims_rope=[16, 56, 56]),
    clip=dict(bos_token_id=0, eos_token_id=2, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
              num_hidden_layers=4, pad_token_id=1, vocab_size=1000, projection_dim=768, max_position_embeddings=77),
    t5=dict(d_model=1024, d_ff=2816, d_kv=64, num_heads=16, num_layers=6, vocab_size=1000, decoder_start_token_id=0),
    vae=dict(sample_size=256, in_channels=3, out_channels=3, block_out_channels=(64, 128, 128), layers_per_block=1,
             down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
             latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
             shift_factor=0.0609, scaling_factor=1.5035),
    image=256, text=64)
"""On a GPU: a 4 + 8 block transformer 1024 wide, CLIP-L-wide and T5 1024-wide encoders, a three-level VAE; 256×256
images. About 720 MiB in bfloat16 (transformer 541, T5 116, CLIP 56, VAE 7 MiB, counted on the meta device)."""
TARGET = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
              num_hidden_layers=8)
DRY_TARGET = dict(TARGET, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=2000, num_hidden_layers=4)


def measure_pipeline(args, dry_run: bool, workdir: Path) -> list[dict]:
    """The pipeline case's rows (module docstring)."""
    import diffusion_pipeline as dp

    shapes = dp.TINY if dry_run else GPU_PIPELINE
    dtype = torch.float32 if dry_run else torch.bfloat16
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        folder = Path(tmp) / "pipeline"
        sizes = {n: b * dtype.itemsize // 4 for n, b in dp.save_pipeline(folder, shapes).items()}   # saved in fp32
        budget = {0: int(1.1 * sizes["transformer"]), "cpu": 2 * sum(sizes.values())}
        rows, _ = dp.run(folder, shapes, sizes, budget, 1 if dry_run else 3, Path(tmp),
                         device="stand-in" if dry_run else "cuda:0", dtype=dtype)
    for row in rows:
        row["pipeline_mib"] = round(sum(sizes.values()) / 2**20, 2)
        row["device"] = "stand-in (CPU times)" if dry_run else "cuda:0"
    return rows


def measure_assisted(args, dry_run: bool, workdir: Path, *, new_tokens: int = 16, share: float = 0.6) -> list[dict]:
    """The assisted-generation case's rows (module docstring)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import allocator
    from allocator import offload

    fields = DRY_TARGET if dry_run else TARGET
    where = "cpu" if dry_run else "cuda:0"
    dtype = torch.float32 if dry_run else torch.bfloat16
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        folders = {}
        for name, layers in (("target", fields["num_hidden_layers"]), ("draft", 1)):
            torch.manual_seed(0)
            with torch.device(where):
                model = AutoModelForCausalLM.from_config(LlamaConfig(**{**fields, "num_hidden_layers": layers}),
                                                         dtype=dtype)
            folders[name] = Path(tmp) / name
            model.save_pretrained(folders[name])
            if name == "target":
                total = sum(t.nbytes for t in model.state_dict().values())
                reference = model.eval()
        prompt = torch.randint(0, fields["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1))
        kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            want = reference.generate(prompt.to(where), **kwargs).cpu()
        del reference
        budget = {"cpu": int(share * total)} if dry_run else {0: int(share * total), "cpu": 2 * total}
        with allocator.patch(runtime="allocator", offload_device="stand-in" if dry_run else None):
            target = AutoModelForCausalLM.from_pretrained(folders["target"], device_map="auto", max_memory=budget,
                                                          offload_folder=str(Path(tmp) / "offload"),
                                                          dtype=dtype).eval()
            draft = AutoModelForCausalLM.from_pretrained(folders["draft"], device_map="auto", dtype=dtype).eval()
        runtime = offload.runtime_of(target)
        main = "cpu" if dry_run else "cuda:0"
        for method in ("target alone", "assisted"):
            extra = {"assistant_model": draft} if method == "assisted" else {}
            times, out = [], None
            with torch.no_grad():
                for _ in range(2):   # the first warms up
                    if not dry_run:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = target.generate(prompt.to(main), **kwargs, **extra)
                    if not dry_run:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            rows.append(dict(method=method, target_mib=round(total / 2**20, 2), target_budget=str(budget),
                             target_map_devices=_devices(target), draft_map_devices=_devices(draft),
                             runtime=type(runtime.device).__name__ if runtime is not None else "accelerate hooks",
                             ms_per_token=round(times[-1] / new_tokens * 1e3, 2),
                             tokens_equal=bool(torch.equal(out.as_subclass(torch.Tensor).cpu(), want)),
                             device="stand-in (CPU times)" if dry_run else "cuda:0"))
            print(f"assisted {method}: {rows[-1]['ms_per_token']} ms/token", file=sys.stderr, flush=True)
        if runtime is not None:
            offload.detach(target)
    return rows


def _devices(model) -> str:
    """The devices of a loaded model's map (transformers sets no ``hf_device_map`` for one device)."""
    where = getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device}
    return " ".join(sorted({str(d) for d in where.values()}))


def guarded(measure, *args, **kwargs) -> list[dict]:
    """``measure``'s rows, or one row saying how it failed (a case failing is a result, reported in the table)."""
    try:
        return measure(*args, **kwargs)
    except Exception as err:   # noqa: BLE001
        return [{"method": measure.__name__, "status": f"{type(err).__name__}: {err}"[:300]}]


def section(title: str, rows: list[dict], note: str) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return (f"\n## {title}\n\n{note}\n\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
            + "\n".join("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows))
