"""``benchmarks/diffusion.py --pipeline``: a small random FluxPipeline (CLIP and T5 text encoders, a Flux transformer,
a VAE) on one budget, three ways, with :class:`allocator.offload.StandInDevice` as the accelerator (no GPU here):

- ``ours``: ``DiffusionPipeline.from_pretrained(device_map="balanced", max_memory=budget)`` under
  ``allocator.patch(runtime="allocator", offload_device="stand-in")``: :func:`allocator.plan_pipeline`'s plan for
  ``{0: ..., "cpu": ...}``, loaded as this machine can (:func:`stood_in`: the accelerator's share in RAM as plain
  tensors, the stand-in's memory; what the plan offloads to RAM on disk, so that our runtime stages it; a moved
  component in RAM, moved onto the stand-in when it runs);
- ``model-offload``: the pipeline in RAM, then diffusers' ``enable_model_cpu_offload(device="cpu")``;
- ``group-offload``: the pipeline in RAM, then ``enable_group_offload(onload_device="cpu", offload_type="block_level",
  num_blocks_per_group=1)``.

Bytes moved host to device per image, counted where each copies: ours, the stand-in's staged bytes (split components,
:attr:`StandInDevice.staged`) and the moves (:attr:`allocator.offload.moved.ModelMoves.moved`); group offloading,
every ``ModuleGroup._transfer_tensor_to_device`` (the one place its onloads copy); model offload, accelerate's
``CpuOffload.pre_forward`` counted as it acts on a GPU (a component not on the device is moved whole; the one before
is offloaded by ``UserCpuOffloadHook.offload``; ``init_hook``, called again by ``maybe_free_model_hooks`` at the end of
each image, puts it back on the CPU). On the CPU the two diffusers methods copy nothing (``.to("cpu")``), and the
stand-in clones: ms per image are CPU times of this machine, not a GPU's (wall clock, and the process's CPU time,
``time.process_time``, which a busy machine disturbs less). Rounds are interleaved (one image per method
per round, the order rotated); ratios are ours / theirs within a round. Every image is compared with the pipeline's in
RAM (``torch.testing.assert_close``, rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

METHODS = ("ours", "model-offload", "group-offload")
SMALL = dict(
    transformer=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=64,
                     num_attention_heads=4, joint_attention_dim=256, pooled_projection_dim=256,
                     axes_dims_rope=[16, 24, 24]),
    clip=dict(bos_token_id=0, eos_token_id=2, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
              num_hidden_layers=4, pad_token_id=1, vocab_size=1000, projection_dim=256, max_position_embeddings=77),
    t5=dict(d_model=256, d_ff=1024, d_kv=64, num_heads=4, num_layers=4, vocab_size=1000, decoder_start_token_id=0),
    vae=dict(sample_size=64, in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1,
             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
             latent_channels=4, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False,
             shift_factor=0.0609, scaling_factor=1.5035),
    image=64, text=16)
"""About 40 MB in float32: a 2 + 4 block transformer 256 wide (most of it), 4-layer text encoders, a two-level VAE;
64×64 images (256 image tokens), 16 text tokens."""
TINY = dict(
    transformer=dict(SMALL["transformer"], in_channels=4, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]),
    clip=dict(SMALL["clip"], hidden_size=32, intermediate_size=37, num_hidden_layers=2, vocab_size=100,
              projection_dim=32, max_position_embeddings=16),
    t5=dict(SMALL["t5"], d_model=32, d_ff=37, d_kv=8, num_layers=2, vocab_size=100),
    vae=dict(SMALL["vae"], sample_size=32, block_out_channels=(4,), latent_channels=1, norm_num_groups=1,
             down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",)),
    image=16, text=8)
"""``--smoke``: under 1 MB, 16×16 images."""


def save_pipeline(folder: Path, shapes: dict, seed: int = 0) -> dict:
    """A random FluxPipeline of ``shapes`` saved in ``folder``; returns its components' bytes."""
    import diffusers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    def tokenizer():
        vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, shapes["clip"]["vocab_size"])}}
        made = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        made.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=made, unk_token="[UNK]", pad_token="[UNK]",
                                       model_max_length=shapes["clip"]["max_position_embeddings"])

    torch.manual_seed(seed)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer(), tokenizer_2=tokenizer(),
        text_encoder=CLIPTextModel(CLIPTextConfig(**shapes["clip"])).eval(),
        text_encoder_2=T5EncoderModel(T5Config(**shapes["t5"])).eval(),
        transformer=diffusers.FluxTransformer2DModel(**shapes["transformer"]).eval(),
        vae=diffusers.AutoencoderKL(**shapes["vae"]).eval())
    pipe.save_pretrained(folder)
    return {n: _bytes(m) for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _bytes(module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


def call(shapes: dict) -> dict:
    """The pipeline call of one image (2 steps, fixed seed)."""
    return dict(prompt="w1 w2 w3 w4", height=shapes["image"], width=shapes["image"], num_inference_steps=2,
                max_sequence_length=shapes["text"], output_type="pt",
                generator=torch.Generator().manual_seed(3))


def stood_in(plan):
    """``plan`` (a :class:`allocator.PipelinePlan` for accelerators) as this machine loads it with the stand-in as the
    accelerator: a component whole on an accelerator gets a map of its own, ``{"": "cpu"}`` (plain tensors in RAM,
    the stand-in's memory); a component with a map of its own keeps the accelerators' share in RAM and puts RAM's on
    the disk (offloaded, so that the runtime stages it), its budgets likewise; a moved component, and one computed on
    the CPU, live in RAM as planned (the patch moves the first onto the stand-in)."""
    execution = getattr(plan, "execution", {})
    components, given = {}, dict(plan.given)
    for name, where in plan.components.items():
        if isinstance(where, dict):
            components[name] = {k: "cpu" if _accelerator(d) else "disk" for k, d in where.items()}
            budgets = plan.given[name]
            given[name] = {"cpu": sum(b for d, b in budgets.items() if _accelerator(d)),
                           "disk": sum(b for d, b in budgets.items() if not _accelerator(d))}
        elif execution.get(name) in ("moved", "cpu"):   # lives in RAM: the runtime moves it, or computes it there
            components[name] = "cpu"
        else:
            components[name], given[name] = {"": "cpu"}, {"cpu": 1 << 40}
    copy = dataclasses.replace(plan, components=components, given=given)
    known = {f.name for f in dataclasses.fields(plan)}
    for key, value in {**{k: v for k, v in vars(plan).items() if k not in known},
                       "runs_on": dict.fromkeys(components, "cpu")}.items():
        object.__setattr__(copy, key, value)   # runs_on before the planner's side of issue #47 made it a field
    return copy


def _same(plan):
    return plan


def _accelerator(device) -> bool:
    return isinstance(device, int)


class Counts:
    """Bytes diffusers' offloading copies host to device, counted where it copies (module docstring)."""

    def __init__(self):
        self.bytes = 0
        self.on: set = set()
        self.saved: list = []

    def __enter__(self):
        from accelerate.hooks import CpuOffload, UserCpuOffloadHook
        from diffusers.hooks.group_offloading import ModuleGroup

        counts = self

        def pre_forward(hook, module, *args, **kwargs):
            if id(module) not in counts.on:
                counts.on.add(id(module))
                counts.bytes += _bytes(module)
            return original["pre"](hook, module, *args, **kwargs)

        def init_hook(hook, module):
            counts.on.discard(id(module))
            return original["init"](hook, module)

        def offload(hook):
            counts.on.discard(id(hook.model))
            return original["offload"](hook)

        def transfer(group, tensor, source, stream):
            counts.bytes += source.nbytes
            return original["transfer"](group, tensor, source, stream)

        original = {"pre": CpuOffload.pre_forward, "init": CpuOffload.init_hook,
                    "offload": UserCpuOffloadHook.offload, "transfer": ModuleGroup._transfer_tensor_to_device}
        self.saved = [(CpuOffload, "pre_forward", pre_forward), (CpuOffload, "init_hook", init_hook),
                      (UserCpuOffloadHook, "offload", offload), (ModuleGroup, "_transfer_tensor_to_device", transfer)]
        self.saved = [(cls, name, getattr(cls, name), new) for cls, name, new in self.saved]
        for cls, name, _, new in self.saved:
            setattr(cls, name, new)
        return self

    def __exit__(self, *exc):
        for cls, name, old, _ in self.saved:
            setattr(cls, name, old)


def sizes_of(shapes: dict) -> dict:
    """``plan_pipeline``'s keywords for the sizes of :func:`call`: ``budget=``, the ``allocator.DiffusionBudget`` the
    planner counts activations at (``allocator.patch(diffusion=...)`` under the patch)."""
    import allocator

    return {"budget": allocator.DiffusionBudget(shapes["image"], shapes["image"], steps=2, text_tokens=shapes["text"])}


def load(method: str, folder: Path, budget: dict, work: Path, *, device: str = "stand-in", dtype=torch.float32,
         shapes: dict = SMALL):
    """The pipeline loaded by ``method`` for ``device`` (``"stand-in"``, or a CUDA device for ``benchmarks/gpu.py``);
    with ours, a function returning the bytes it has moved so far (on a GPU: the moves only)."""
    import diffusers

    import allocator
    from allocator import offload
    from allocator.integrations import diffusers as integration
    from allocator.offload.moved import moves_of

    diffusers.utils.logging.disable_progress_bar()
    standin = device == "stand-in"
    if method == "ours":
        real = integration.plan_pipeline   # the patch's plan, as this machine loads it
        integration.plan_pipeline = lambda *a, **k: (stood_in if standin else _same)(real(*a, **k))
        try:   # planned at the sizes the benchmark runs
            with allocator.patch(runtime="allocator", offload_device="stand-in" if standin else None,
                                 diffusion=sizes_of(shapes)["budget"]):
                pipe = diffusers.FluxPipeline.from_pretrained(folder, device_map="balanced", max_memory=dict(budget),
                                                              offload_folder=str(work / "offload"), torch_dtype=dtype)
        finally:
            integration.plan_pipeline = real
        runtimes = [r for r in (offload.runtime_of(m) for m in pipe.components.values()
                                if isinstance(m, torch.nn.Module)) if r is not None]
        moves = moves_of(pipe)
        pipe.set_progress_bar_config(disable=True)
        return pipe, lambda: (sum(getattr(r.device, "staged", 0) for r in runtimes) + (moves.moved if moves else 0))
    pipe = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    target = torch.device("cpu" if standin else device)
    if method == "model-offload":
        pipe.enable_model_cpu_offload(device=target)
    else:
        pipe.enable_group_offload(onload_device=target, offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1, use_stream=not standin)
    return pipe, None


def run(folder: Path, shapes: dict, sizes: dict, budget: dict, rounds: int, work: Path, *, device: str = "stand-in",
        dtype=torch.float32) -> tuple[list[dict], str]:
    """Every method over ``rounds`` interleaved rounds; rows and the plan's explanation. On a CUDA ``device`` the
    reference is the pipeline whole on it, images are compared at bf16's tolerance (rtol and atol 1e-2) and each row
    has the device's peak (``torch.cuda.max_memory_allocated`` over the method's images)."""
    import diffusers

    import allocator

    gpu = device != "stand-in"
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    diffusers.utils.logging.disable_progress_bar()
    ram = diffusers.FluxPipeline.from_pretrained(folder, torch_dtype=dtype)
    ram.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = (ram.to(device) if gpu else ram)(**call(shapes)).images.cpu()
    del ram
    pipes, moved = {}, {}
    with Counts() as counts:
        for method in METHODS:
            pipes[method], moved[method] = load(method, folder, budget, work, device=device, dtype=dtype,
                                                shapes=shapes)
        times = {m: [] for m in METHODS}
        cpu = {m: [] for m in METHODS}
        copied = {m: [] for m in METHODS}
        peaks = dict.fromkeys(METHODS, 0)
        equal = dict.fromkeys(METHODS, True)
        with torch.no_grad():
            for r in range(rounds + 1):   # round 0 warms up: not timed
                for method in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
                    before = moved[method]() if moved[method] else counts.bytes
                    if gpu:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    got = pipes[method](**call(shapes)).images
                    if gpu:
                        torch.cuda.synchronize()
                        peaks[method] = max(peaks[method], torch.cuda.max_memory_allocated())
                    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                    after = moved[method]() if moved[method] else counts.bytes
                    try:
                        torch.testing.assert_close(got.as_subclass(torch.Tensor).cpu(), want, **tolerance)
                    except AssertionError:
                        equal[method] = False
                    if r:
                        times[method].append(seconds)
                        cpu[method].append(cpu_seconds)
                        copied[method].append(after - before)
    plan = allocator.plan_pipeline(folder, budget, dtype=dtype, balanced=True, **sizes_of(shapes))   # as the patch
    rows = []
    for method in METHODS:
        ratios = [a / b for a, b in zip(times["ours"], times[method])]
        cpu_ratios = [a / b for a, b in zip(cpu["ours"], cpu[method])]
        rows.append(dict(method=method, ms_per_image=round(statistics.median(times[method]) * 1e3, 1),
                         ours_over_this=round(statistics.median(ratios), 3),
                         cpu_ms_per_image=round(statistics.median(cpu[method]) * 1e3, 1),
                         cpu_ours_over_this=round(statistics.median(cpu_ratios), 3),
                         mib_moved_per_image=round(statistics.median(copied[method]) / 2**20, 3),
                         equal_to_ram=equal[method], rounds=rounds,
                         **({"gpu_peak_mib": round(peaks[method] / 2**20, 1)} if gpu else {})))
    return rows, plan.explain()


def table(rows: list[dict], sizes: dict, budget: dict, shapes: dict, header: str, explained: str) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"   # noqa: E731
    lines = [header, "",
             f"Pipeline: FluxPipeline, random, float32: {', '.join(f'{n} {mib(b)}' for n, b in sizes.items())}; "
             f"{shapes['image']}×{shapes['image']} images, 2 steps. Budget {{0: {mib(budget[0])}, 'cpu': "
             f"{mib(budget['cpu'])}}}, the stand-in as GPU 0 (its copies are clones in RAM; diffusers' copies to "
             "'cpu' are none): ms are CPU times here, not a GPU's.", "",
             "| method | MiB moved host→device / image | ms / image (median) | ours ÷ this (median of rounds) "
             "| CPU ms / image (process time) | ours ÷ this, CPU time | image equal to RAM (rtol 1e-4, atol 1e-5) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['mib_moved_per_image']} | {r['ms_per_image']} | {r['ours_over_this']} | "
                     f"{r['cpu_ms_per_image']} | {r['cpu_ours_over_this']} | {r['equal_to_ram']} |")
    lines += ["", "The plan (`allocator.plan_pipeline`, an estimate from the configs):", "", "```", explained, "```"]
    return "\n".join(lines) + "\n"


def main(args, header: str) -> tuple[list[dict], str]:
    """``benchmarks/diffusion.py --pipeline``: rows and the markdown."""
    import tempfile

    shapes = TINY if args.smoke else SMALL
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pipeline"
        sizes = save_pipeline(folder, shapes)
        budget = {0: int(1.1 * sizes["transformer"]), "cpu": 2 * sum(sizes.values())}
        rows, explained = run(folder, shapes, sizes, budget, args.rounds, Path(tmp))
    return rows, table(rows, sizes, budget, shapes, header, explained)
