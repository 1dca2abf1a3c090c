"""Small random diffusers models for the tests (nothing downloaded): a Flux transformer and an SD3 transformer with
their inputs, and what a device map keeps per device counted from the model's own tensors."""

from __future__ import annotations

import torch

FLUX = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=4, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
SD3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
           joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
           pos_embed_max_size=16)


def flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**FLUX).eval()


def sd3(seed: int = 0):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(**SD3).eval()


def flux_inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 4, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), return_dict=False)


def sd3_inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([500]), return_dict=False)


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def bytes_on(model, device_map: dict, device) -> int:
    """Bytes of ``model``'s state dict that ``device_map`` puts on ``device`` (longest matching prefix)."""
    total = 0
    for name, tensor in model.state_dict().items():
        key = name
        while key not in device_map and key:
            key = key.rpartition(".")[0]
        if device_map.get(key, device_map.get("")) == device:
            total += tensor.numel() * tensor.element_size()
    return total


FLUX_DEV = {
    "model_index.json": {
        "_class_name": "FluxPipeline", "_diffusers_version": "0.30.0.dev0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]},
    "transformer/config.json": {
        "_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "guidance_embeds": True,
        "in_channels": 64, "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19,
        "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]},
    "text_encoder/config.json": {
        "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_size": 768,
        "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12, "vocab_size": 49408,
        "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu", "torch_dtype": "bfloat16"},
    "text_encoder_2/config.json": {
        "architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": 4096, "d_ff": 10240, "d_kv": 64,
        "num_heads": 64, "num_layers": 24, "vocab_size": 32128, "feed_forward_proj": "gated-gelu",
        "relative_attention_num_buckets": 32, "is_encoder_decoder": True, "torch_dtype": "bfloat16"},
    "vae/config.json": {
        "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
        "in_channels": 3, "out_channels": 3, "latent_channels": 16, "layers_per_block": 2, "norm_num_groups": 32,
        "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
        "use_post_quant_conv": False, "force_upcast": True},
    "scheduler/scheduler_config.json": {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": True},
}
"""black-forest-labs/FLUX.1-dev's configs (model_index.json and each component's), written out: no weights."""


def write_configs(folder, files: dict = FLUX_DEV) -> str:
    """Write ``files`` (relative path -> JSON data) under ``folder``; return it."""
    import json
    import os

    for path, data in files.items():
        full = os.path.join(folder, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            json.dump(data, f)
    return str(folder)
