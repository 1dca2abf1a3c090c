"""A tiny random FluxPipeline saved by ``save_pretrained`` (CLIP and T5 text encoders, a Flux transformer, a VAE,
word-level tokenizers made without a download), and the call that makes a 16×16 image from it in 2 steps."""

from __future__ import annotations

import torch

from diffusion_models import FLUX

CLIP = dict(bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, pad_token_id=1, vocab_size=100, projection_dim=32, max_position_embeddings=16)
T5 = dict(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, vocab_size=100, decoder_start_token_id=0)
VAE = dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
           latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
           scaling_factor=1.5035)
FLUX_PIPELINE = dict(transformer=dict(FLUX, num_layers=2, num_single_layers=4), clip=CLIP, t5=T5, vae=VAE)
"""A tiny FluxPipeline (CLIP and T5 text encoders, 2 + 4 block transformer, one-level VAE; about 0.75 MB in float32),
shaped as diffusers' own Flux pipeline tests shape theirs."""
FLUX_CALL = dict(prompt="w1 w2 w3", height=16, width=16, num_inference_steps=2, max_sequence_length=8,
                 output_type="pt")
"""A 16×16 image in 2 steps from :data:`FLUX_PIPELINE` (pass ``generator=`` for a fixed seed)."""


def word_tokenizer(vocab_size: int = 100, max_length: int = 16):
    """A word-level tokenizer (``w1`` ... ``w{vocab_size - 1}``, ``[UNK]`` as id 0), made without a download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}},
                                           unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[UNK]",
                                   model_max_length=max_length)


def save_flux_pipeline(folder, shapes: dict = FLUX_PIPELINE, seed: int = 0) -> str:
    """A random FluxPipeline of ``shapes`` saved in ``folder`` by ``save_pretrained``; returns the folder."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), text_encoder=CLIPTextModel(CLIPTextConfig(
            **shapes["clip"])), tokenizer=word_tokenizer(), text_encoder_2=T5EncoderModel(T5Config(**shapes["t5"])),
        tokenizer_2=word_tokenizer(), transformer=diffusers.FluxTransformer2DModel(**shapes["transformer"]),
        vae=diffusers.AutoencoderKL(**shapes["vae"]))
    pipe.save_pretrained(folder)
    return str(folder)
