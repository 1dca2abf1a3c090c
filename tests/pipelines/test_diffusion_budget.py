""":class:`allocator.DiffusionBudget`'s activation peaks against the live tensor bytes of small real components
measured on the CPU (the torch profiler's running sum of allocations during the forward, as
``benchmarks/prefill_memory.profiled_peak`` measures a prefill), at two sizes per component kind, in bfloat16 (the
dtype the plans are made in): within 25 %.

The small components keep the real ones' ratios (feed-forward width over hidden width, the VAEs' channel
progressions); their weights are random and allocated before the measurement starts, so only what the forward
allocates is counted."""

from __future__ import annotations

import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from prefill_memory import profiled_peak  # noqa: E402

from allocator import DiffusionBudget, InvalidOption  # noqa: E402
from allocator.pipelines.budget import activation_peaks, batches_guidance, denoiser_tokens  # noqa: E402

TOLERANCE = 0.25
BF16 = torch.bfloat16
TEXT = 64
NATIVE_BF16_CONV = torch.cpu._is_avx512_bf16_supported() and os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in (
    "", "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX10_1_512_AMX")
"""Whether this CPU runs bfloat16 convolutions natively (oneDNN with AVX-512 BF16). Below it, oneDNN converts each
bfloat16 convolution's tensors to float32 on the side (measured with ``ONEDNN_MAX_CPU_ISA=AVX2``: the VAE decodes'
peaks 1.5-2x the estimate), which a GPU does not do: the VAE measurements are only meaningful where it is native."""


def measured(run) -> int:
    with torch.no_grad():
        return profiled_peak(run)


def meta(cls, **config):
    with torch.device("meta"):
        return cls(**config)


def flux_vae():
    return meta(diffusers.AutoencoderKL, block_out_channels=(128, 256, 512, 512), latent_channels=16,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)


def predicted(name, module, budget, vae=None):
    parts = {name: module} | ({"vae": vae} if vae is not None else {})
    return activation_peaks(parts, budget, dtype=BF16)[name]


def flux(side):
    torch.manual_seed(0)
    m = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                         attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                                         pooled_projection_dim=32, axes_dims_rope=[8, 12, 12]).eval().to(BF16)
    n = (side // 16) ** 2
    args = dict(hidden_states=torch.randn(1, n, 64, dtype=BF16), encoder_hidden_states=torch.randn(1, TEXT, 64,
                dtype=BF16), pooled_projections=torch.randn(1, 32, dtype=BF16), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(n, 3), txt_ids=torch.zeros(TEXT, 3), return_dict=False)
    return m, lambda: m(**args), flux_vae()


def qwen_image(side):
    torch.manual_seed(0)
    m = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                                              axes_dims_rope=(8, 12, 12)).eval().to(BF16)
    n = (side // 16) ** 2
    args = dict(hidden_states=torch.randn(1, n, 64, dtype=BF16), encoder_hidden_states=torch.randn(1, TEXT, 64,
                dtype=BF16), encoder_hidden_states_mask=None, timestep=torch.tensor([0.5]),
                img_shapes=[(1, side // 16, side // 16)], return_dict=False)
    return m, lambda: m(**args), meta(diffusers.AutoencoderKLQwenImage)


def z_image(side):
    torch.manual_seed(0)
    m = diffusers.ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=128,
                                           n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=64,
                                           axes_dims=[8, 12, 12], axes_lens=[256, 128, 128]).eval().to(BF16)
    x, cap = [torch.randn(16, 1, side // 8, side // 8, dtype=BF16)], [torch.randn(TEXT, 64, dtype=BF16)]
    return m, lambda: m(x, torch.tensor([0.5]), cap, return_dict=False), flux_vae()


def wan(side, frames=9):
    torch.manual_seed(0)
    m = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32,
                                        in_channels=16, out_channels=16, text_dim=64, freq_dim=32, ffn_dim=346,
                                        num_layers=2, rope_max_seq_len=256).eval().to(BF16)   # ffn 2.7 x width
    x = torch.randn(1, 16, 1 + (frames - 1) // 4, side // 8, side // 8, dtype=BF16)
    text = torch.randn(1, TEXT, 64, dtype=BF16)
    return m, lambda: m(hidden_states=x, timestep=torch.tensor([500]), encoder_hidden_states=text,
                        return_dict=False), meta(diffusers.AutoencoderKLWan)


DENOISERS = {"flux": (flux, (512, 1024), 1), "qwen_image": (qwen_image, (512, 1024), 1),
             "z_image": (z_image, (512, 1024), 1), "wan": (wan, (256, 512), 9)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(DENOISERS))
def test_denoiser_activations_within_a_quarter_of_the_measured_at_two_sizes(kind):
    make, sides, frames = DENOISERS[kind]
    for side in sides:
        model, run, vae = make(side)
        budget = DiffusionBudget(side, side, frames=frames, text_tokens=TEXT)
        got, want = measured(run), predicted("transformer", model, budget, vae)
        assert abs(want / got - 1) <= TOLERANCE, (kind, side, want, got, want / got)


def kl_vae():
    torch.manual_seed(0)   # FLUX's channel progression (128, 256, 512, 512) over 4
    return diffusers.AutoencoderKL(block_out_channels=(32, 64, 128, 128), down_block_types=("DownEncoderBlock2D",) * 4,
                                   up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16, norm_num_groups=8,
                                   layers_per_block=2).eval().to(BF16)


def causal_vae(cls):
    torch.manual_seed(0)   # Wan's and Qwen-Image's (base 96) over 6
    return cls(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2).eval().to(BF16)


@pytest.mark.slow
@pytest.mark.skipif(not NATIVE_BF16_CONV, reason="bfloat16 convolutions not native on this CPU (NATIVE_BF16_CONV)")
@pytest.mark.parametrize("kind,sides,frames", [("kl", (128, 256), 1), ("qwen_image", (128, 256), 1),
                                               ("wan", (96, 128), 9)])
def test_vae_decode_within_a_quarter_of_the_measured_at_two_sizes(kind, sides, frames):
    vae = kl_vae() if kind == "kl" else causal_vae(
        diffusers.AutoencoderKLQwenImage if kind == "qwen_image" else diffusers.AutoencoderKLWan)
    for side in sides:
        shape = (1, 16, side // 8, side // 8) if kind == "kl" else (1, 16, 1 + (frames - 1) // 4, side // 8, side // 8)
        z = torch.randn(*shape, dtype=BF16)
        got = measured(lambda: vae.decode(z))
        want = predicted("vae", vae, DiffusionBudget(side, side, frames=frames))
        assert abs(want / got - 1) <= TOLERANCE, (kind, side, want, got, want / got)


def t5():
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=128, d_ff=320, d_kv=16, num_heads=8, num_layers=2, vocab_size=1000,
                                   feed_forward_proj="gated-gelu")   # T5-XXL's d_ff / d_model = 2.5
    m = transformers.T5EncoderModel(config).eval().to(BF16)
    return m, lambda ids: m(input_ids=ids)


def qwen3():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=8, vocab_size=1000,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    m = transformers.Qwen3Model(config).eval().to(BF16)
    return m, lambda ids: m(input_ids=ids, output_hidden_states=True)


@pytest.mark.slow
@pytest.mark.parametrize("make", [t5, qwen3])
def test_text_encoder_within_a_quarter_of_the_measured_at_two_lengths(make):
    model, run = make()
    for length in (256, 512):
        ids = torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(0))
        got = measured(lambda: run(ids))
        want = predicted("text_encoder", model, DiffusionBudget(512, 512, text_tokens=length))
        assert abs(want / got - 1) <= TOLERANCE, (make.__name__, length, want, got, want / got)


def test_guidance_doubles_the_denoiser_batch_only_where_the_installed_pipeline_batches_it():
    """SD3 and Z-Image concatenate the conditional and unconditional latents; Qwen-Image and Wan run two forwards,
    FLUX.1-dev embeds its guidance: read from the installed diffusers' ``__call__``."""
    assert batches_guidance("StableDiffusion3Pipeline") and batches_guidance("ZImagePipeline")
    assert not any(batches_guidance(c) for c in ("FluxPipeline", "QwenImagePipeline", "WanPipeline", None, "Nope"))
    model, vae = meta(diffusers.SD3Transformer2DModel, num_layers=1), flux_vae()
    on = activation_peaks({"transformer": model, "vae": vae}, DiffusionBudget(1024, 1024),
                          pipeline_class="StableDiffusion3Pipeline")
    off = activation_peaks({"transformer": model, "vae": vae}, DiffusionBudget(1024, 1024, guidance=1.0),
                           pipeline_class="StableDiffusion3Pipeline")
    assert on["transformer"] == 2 * off["transformer"] > 0 and on["vae"] == off["vae"] > 0


def test_tokens_follow_the_latent_packing_and_the_joint_text():
    """FLUX packs 2x2 latents (64 input channels of 16) over an 8x VAE: 1024² is 64² image tokens plus 512 text
    tokens; Wan's 81 frames are 21 latent frames of (480/16) x (832/16) tokens, its text attended across."""
    flux_model = meta(diffusers.FluxTransformer2DModel, num_layers=1, num_single_layers=1)
    assert denoiser_tokens(flux_model, flux_vae(), DiffusionBudget(1024, 1024)) == 64 * 64 + 512
    wan_model = meta(diffusers.WanTransformer3DModel, num_layers=1)
    assert denoiser_tokens(wan_model, meta(diffusers.AutoencoderKLWan),
                           DiffusionBudget(480, 832, frames=81)) == 21 * 30 * 52


@pytest.mark.parametrize("bad", [dict(height=0, width=8), dict(height=8, width=8.0), dict(height=8, width=8,
                                 guidance="high"), dict(height=8, width=8, steps=True)])
def test_a_budget_that_is_not_sizes_says_so(bad):
    with pytest.raises(InvalidOption, match="DiffusionBudget"):
        DiffusionBudget(**bad)
