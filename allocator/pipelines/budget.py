"""The sizes a diffusion pipeline is run at (:class:`DiffusionBudget`), and what each component needs in memory while
it runs at them: its activation peak, computed from the components' configs (nothing is run).

Every figure here is an *estimate*. The formulas (``docs/diffusers.md``) count the tensors one block holds at once at
the budget's sizes, in the compute dtype:

denoiser (a transformer)
    ``batch' x tokens x bytes x (7·D + 2·F')``: seven hidden-width copies (the block's input and residual, the
    normalised and modulated input, query, key, value, the attention's output) and two copies at the feed-forward
    width (its projection and the activation of it), ``F' = 1.5·F`` for a gated feed-forward (SwiGLU: two
    projections and their product). ``D`` is ``num_attention_heads x attention_head_dim`` (or ``dim``), ``F`` the
    config's ``ffn_dim`` (or the gated projection's width, else ``4·D``). ``tokens`` is ``latent frames x (height /
    (s·p)) x (width / (s·p))`` with ``s`` the VAE's spatial factor and ``p`` the patch (or the pipeline's 2x2
    packing, ``in_channels / latent channels``), plus the text tokens where text and image attend jointly (MMDiT,
    single-stream). ``batch'`` is the batch, doubled where the pipeline runs classifier-free guidance as one batch
    (:func:`batches_guidance`) and guidance is on.
text encoder
    ``batch x L x bytes x (7·D + 2·F')`` at ``L = min(text_tokens, max_position_embeddings)``, plus every layer's
    hidden state for a decoder language model (the pipelines ask for ``output_hidden_states``), its logits over the
    vocabulary where it has a head, and T5's eager attention: ``batch x heads x L² x (bytes + 4)``, the position bias
    it keeps through the layers and the softmax it computes in float32.
VAE decode
    a 2-D VAE (``AutoencoderKL``): ``4 x C x batch x frames x height x width x bytes``, ``C`` the channels entering
    the last up block (``block_out_channels[1]``): the first resnet there holds its input, normalised and activated
    copies, and the half-width outputs of its convolution and shortcut. A causal 3-D VAE (Wan, Qwen-Image) decodes
    one latent frame at a time (``T`` output frames: 1 for the first, the temporal factor after it) and keeps two
    frames of every causal convolution's input as a cache: ``(12·T + 10) x C x batch x height x width x bytes``, ``C``
    its full-resolution channels (``decoder_base_dim`` or ``base_dim``); these two coefficients are read off CPU
    measurements of small VAEs (``tests/pipelines/test_diffusion_budget.py``), not counted tensor by tensor.

Checked against live tensor bytes measured on small real components on the CPU at two sizes each (bfloat16; the
torch profiler, ``benchmarks/prefill_memory.profiled_peak``): within 25 %
(``tests/pipelines/test_diffusion_budget.py``).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidOption
from ..model.sizes import as_dtype, dtype_bytes
from .components import DENOISERS

__all__ = ["DiffusionBudget", "JOINT", "activation_peaks", "batches_guidance", "component_kind", "denoiser_tokens",
           "vae_factors"]

log = logging.getLogger("allocator.pipelines")

JOINT = ("FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel", "ZImageTransformer2DModel",
         "SD3Transformer2DModel", "ChromaTransformer2DModel", "HiDreamImageTransformer2DModel",
         "CogView4Transformer2DModel", "HunyuanVideoTransformer3DModel", "AuraFlowTransformer2DModel",
         "LuminaNextDiT2DModel", "Lumina2Transformer2DModel", "OmniGenTransformer2DModel")
"""Denoiser classes whose blocks run text and image tokens as one sequence (MMDiT, single-stream): their tokens
include the text's. The others (Wan, PixArt, Sana, DiT) attend to the text across (cross-attention), whose keys and
values at the text length are small beside the image's tokens."""

HIDDEN_COPIES = 7
"""Hidden-width tensors one transformer block holds at once (input, residual, normalised input, query, key, value,
attention output)."""
FFN_COPIES = 2
"""Feed-forward-width tensors held at once (the projection and its activation)."""
KL_COPIES = 4
"""A 2-D VAE's last up block: its first resnet's input, normalised and activated copies (3) and the half-width outputs
of its convolution and shortcut (2 x 1/2), at full resolution, in units of the block's input channels."""
CAUSAL_PER_FRAME, CAUSAL_CACHE = 12, 10
"""A causal 3-D VAE's decode at full resolution, in units of its full-resolution channels: per output frame of the
chunk it decodes at once, and for the frames its causal convolutions cache (read off measurements, see above)."""


@dataclass(frozen=True, slots=True)
class DiffusionBudget:
    """The sizes a pipeline is run at: what each component's activations are counted for.

    Parameters
    ----------
    height, width : int
        The image (or video frame) size in pixels.
    frames : int
        Frames of a video (1 for an image).
    batch : int
        Images (videos) generated together (``num_images_per_prompt`` x prompts).
    steps : int
        Denoising steps: the denoiser runs this many times per image.
    guidance : float, optional
        The guidance scale. Where the pipeline runs classifier-free guidance as one batch (the conditional and
        unconditional inputs concatenated, :func:`batches_guidance`) and guidance is on (``> 1``; ``None``: the
        pipeline's default, on), the denoiser's batch doubles.
    text_tokens : int
        The text sequence length (the pipelines' ``max_sequence_length``, 512 for T5, umT5 and the LLM encoders);
        a text encoder with fewer positions (CLIP: 77) runs at its own.

    Raises
    ------
    InvalidOption
        A size that is not a positive integer, or a guidance that is not a number.

    Examples
    --------
    >>> DiffusionBudget(1024, 1024).pixels
    1048576
    >>> DiffusionBudget(480, 832, frames=81, steps=50).frames
    81
    """

    height: int
    width: int
    frames: int = 1
    batch: int = 1
    steps: int = 28
    guidance: float | None = None
    text_tokens: int = 512

    def __post_init__(self):
        for name in ("height", "width", "frames", "batch", "steps", "text_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidOption(f"DiffusionBudget.{name} must be a positive int, got {value!r}; e.g. "
                                    "DiffusionBudget(1024, 1024, steps=28).")
        if self.guidance is not None and (isinstance(self.guidance, bool) or not isinstance(self.guidance,
                                                                                               (int, float))):
            raise InvalidOption(f"DiffusionBudget.guidance must be a number (the guidance scale) or None, got "
                                f"{self.guidance!r}.")

    @property
    def pixels(self) -> int:
        """Pixels of one frame."""
        return self.height * self.width

    def guided(self, pipeline_class: str | None) -> int:
        """The factor guidance multiplies the denoiser's batch by: 2 where ``pipeline_class`` batches it and it is
        on, else 1."""
        on = self.guidance is None or self.guidance > 1
        return 2 if on and batches_guidance(pipeline_class) else 1


def batches_guidance(pipeline_class: str | None) -> bool:
    """Whether the installed diffusers' ``pipeline_class`` runs classifier-free guidance as one batch of the
    conditional and unconditional inputs (its ``__call__`` concatenates or repeats the latents twice), rather than
    as two forwards (Qwen-Image, Wan) or not at all (FLUX.1-dev's embedded guidance). Unknown classes: ``False``."""
    if not pipeline_class:
        return False
    try:
        import diffusers

        source = inspect.getsource(getattr(diffusers, pipeline_class).__call__)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    compact = source.replace(" ", "")
    return any(p in compact for p in ("[latents]*2", "latents.repeat(2", "latents_typed.repeat(2",
                                      "[latent_model_input]*2"))


def component_kind(name: str, component) -> str:
    """``"denoiser"``, ``"text_encoder"``, ``"vae"`` or ``"other"``, from the component's name in the pipeline."""
    if name in DENOISERS:
        return "denoiser"
    if name.startswith(("text_encoder", "image_encoder")):
        return "text_encoder"
    if name == "vae" or name.startswith("vae"):
        return "vae"
    return "other"


def activation_peaks(components: Mapping, budget: DiffusionBudget, *, dtype=None,
                     pipeline_class: str | None = None) -> dict:
    """Each component's activation peak in bytes while it runs at ``budget``'s sizes (an estimate; see the module's
    formulas). ``components``: name -> :class:`allocator.pipelines.Component` (or module). Components of no kind
    this module knows (a safety checker, an image processor) count 0, and a log line says so."""
    modules = {n: getattr(c, "model", c) for n, c in components.items()}
    vae = next((m for n, m in modules.items() if component_kind(n, m) == "vae"), None)
    peaks = {}
    for name, module in modules.items():
        kind = component_kind(name, module)
        size = _bytes(module, dtype)
        if kind == "denoiser":
            peaks[name] = _denoiser(module, vae, budget, size, pipeline_class)
        elif kind == "text_encoder":
            peaks[name] = _text_encoder(module, budget, size)
        elif kind == "vae":
            peaks[name] = _vae_decode(module, budget, size)
        else:
            log.info("no activation formula for pipeline component %r (%s): counted 0", name, type(module).__name__)
            peaks[name] = 0
    return peaks


def denoiser_tokens(denoiser, vae, budget: DiffusionBudget) -> int:
    """Tokens one denoiser step runs through its blocks, per batch entry: image tokens at the latent size over the
    patch, plus the text tokens where the blocks attend jointly (:data:`JOINT`)."""
    config = _config(denoiser)
    spatial, temporal = vae_factors(vae)
    patch = max(_patch(config), _packing(config, vae))
    frames = 1 + (budget.frames - 1) // temporal if temporal > 1 else budget.frames
    tokens = frames * math.ceil(budget.height / (spatial * patch)) * math.ceil(budget.width / (spatial * patch))
    if type(denoiser).__name__ in JOINT:
        tokens += budget.text_tokens
    return tokens


def _denoiser(model, vae, budget: DiffusionBudget, size: float, pipeline_class) -> int:
    config = _config(model)
    width = _width(config)
    if width is None:
        log.info("denoiser %s: no hidden width in its config; its activations are counted 0", type(model).__name__)
        return 0
    ffn = _ffn(model, config, width)
    batch = budget.batch * budget.guided(pipeline_class)
    return int(batch * denoiser_tokens(model, vae, budget) * size * (HIDDEN_COPIES * width + FFN_COPIES * ffn))


def _text_encoder(model, budget: DiffusionBudget, size: float) -> int:
    config = _config(model)
    config = getattr(config, "text_config", None) or config
    width = _get(config, "hidden_size", "d_model")
    if width is None:
        return 0
    positions = _get(config, "max_position_embeddings", "n_positions")
    length = min(budget.text_tokens, positions) if positions else budget.text_tokens
    ffn = _get(config, "intermediate_size", "d_ff") or 4 * width
    if _gated_names(model) or str(_get(config, "feed_forward_proj") or "").startswith("gated"):
        ffn = 1.5 * ffn
    per_token = HIDDEN_COPIES * width + FFN_COPIES * ffn
    layers = _get(config, "num_hidden_layers", "num_layers") or 0
    kind = str(_get(config, "model_type") or "")
    if not kind.startswith(("t5", "umt5", "clip", "bert", "mt5")):   # a decoder language model: every hidden state
        per_token += (layers + 1) * width
    if hasattr(model, "lm_head"):
        per_token += _get(config, "vocab_size") or 0
    total = budget.batch * length * size * per_token
    if _get(config, "relative_attention_num_buckets"):    # T5: the position bias held, the float32 softmax
        total += budget.batch * (_get(config, "num_heads") or 1) * length * length * (size + 4)
    return int(total)


def _vae_decode(model, budget: DiffusionBudget, size: float) -> int:
    config = _config(model)
    area = budget.batch * budget.pixels * size
    if _get(config, "temperal_downsample") is not None:   # a causal 3-D VAE, one latent frame at a time
        channels = _get(config, "decoder_base_dim") or _get(config, "base_dim") or 96
        _, temporal = vae_factors(model)
        chunk = 1 if budget.frames == 1 else temporal
        return int(area * channels * (CAUSAL_PER_FRAME * chunk + CAUSAL_CACHE))
    blocks = _get(config, "block_out_channels")
    if not blocks:
        log.info("VAE %s: no block_out_channels in its config; its decode is counted 0", type(model).__name__)
        return 0
    channels = blocks[1] if len(blocks) > 1 else blocks[0]
    return int(KL_COPIES * channels * area * budget.frames)


def vae_factors(vae) -> tuple[int, int]:
    """(spatial, temporal) compression of the VAE: ``2 ** (len(block_out_channels) - 1)`` for a 2-D VAE, the
    config's factors (or 8 and ``2 ** sum(temperal_downsample)``) for a causal 3-D one."""
    if vae is None:
        return 8, 1
    config = _config(vae)
    down = _get(config, "temperal_downsample")
    if down is not None:
        return (_get(config, "scale_factor_spatial") or 2 ** len(down),
                _get(config, "scale_factor_temporal") or 2 ** sum(bool(d) for d in down))
    blocks = _get(config, "block_out_channels") or (0,) * 4
    return 2 ** (len(blocks) - 1), 1


def _patch(config) -> int:
    patch = _get(config, "patch_size", "all_patch_size")
    if isinstance(patch, (list, tuple)):
        patch = patch[-1]
    return int(patch or 1)


def _packing(config, vae) -> int:
    """The pipeline's packing of latents into tokens (FLUX packs 2x2 latents: 64 input channels of 16 latent
    ones): ``sqrt(in_channels / latent channels)``."""
    latent = _get(_config(vae), "latent_channels", "z_dim") if vae is not None else None
    channels = _get(config, "in_channels")
    if not latent or not channels or channels % latent:
        return 1
    return max(1, math.isqrt(channels // latent))


def _width(config):
    heads, dim = _get(config, "num_attention_heads"), _get(config, "attention_head_dim")
    if heads and dim:
        return heads * dim
    return _get(config, "dim", "hidden_size", "inner_dim")


def _ffn(model, config, width: int) -> float:
    gated = _gated_names(model)
    ffn = _get(config, "ffn_dim") or (gated[0] if gated else 4 * width)
    return 1.5 * ffn if gated else ffn


def _gated_names(model) -> list:
    """Widths of a gated feed-forward's first projection (``w1`` beside ``w3``, ``gate_proj``, ``wi_0``), in module
    order; empty where the feed-forward is not gated."""
    names = dict(model.named_modules())
    found = []
    for name, module in names.items():
        last = name.rpartition(".")[2]
        if (last == "w1" and f"{name[:-2]}w3" in names) or last in ("gate_proj", "wi_0"):
            width = getattr(module, "out_features", None)
            if width:
                found.append(width)
                break
    return found


def _bytes(model, dtype) -> float:
    """Bytes per element the component computes in: ``dtype`` if given, else its first floating parameter's."""
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return 4.0
    return float(dtype_bytes(as_dtype(dtype, "dtype"))[0])


def _config(model):
    return getattr(model, "config", None) or {}


def _get(config, *keys):
    for key in keys:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if value is not None:
            return value
    return None
