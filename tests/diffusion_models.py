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


FLUX_VAE = FLUX_DEV["vae/config.json"]

QWEN_IMAGE = {
    "model_index.json": {
        "_class_name": "QwenImagePipeline", "_diffusers_version": "0.35.0.dev0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage"]},
    "transformer/config.json": {
        "_class_name": "QwenImageTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
        "guidance_embeds": False, "in_channels": 64, "joint_attention_dim": 3584, "num_attention_heads": 24,
        "num_layers": 60, "out_channels": 16, "patch_size": 2},
    "text_encoder/config.json": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                          "in_chans": 3, "hidden_act": "silu", "tokens_per_second": 2}},
    "vae/config.json": {
        "_class_name": "AutoencoderKLQwenImage", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0},
    "scheduler/scheduler_config.json": {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
        "use_dynamic_shifting": True},
}
"""Qwen/Qwen-Image's configs: the 20B MMDiT (60 blocks of 24 x 128), Qwen2.5-VL-7B as text encoder, its causal VAE."""

Z_IMAGE_TURBO = {
    "model_index.json": {
        "_class_name": "ZImagePipeline", "_diffusers_version": "0.36.0.dev0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "Qwen3Model"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"]},
    "transformer/config.json": {
        "_class_name": "ZImageTransformer2DModel", "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
        "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-05,
        "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
        "axes_lens": [1536, 512, 512]},
    "text_encoder/config.json": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"},
    "vae/config.json": FLUX_VAE,
    "scheduler/scheduler_config.json": {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": False},
}
"""Tongyi-MAI/Z-Image-Turbo's configs: the 6B single-stream DiT (30 blocks of width 3840), Qwen3-4B as text encoder,
FLUX's VAE."""

WAN_T2V_14B = {
    "model_index.json": {
        "_class_name": "WanPipeline", "_diffusers_version": "0.33.0.dev0",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"]},
    "transformer/config.json": {
        "_class_name": "WanTransformer3DModel", "added_kv_proj_dim": None, "attention_head_dim": 128,
        "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 13824, "freq_dim": 256, "image_dim": None,
        "in_channels": 16, "num_attention_heads": 40, "num_layers": 40, "out_channels": 16, "patch_size": [1, 2, 2],
        "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096},
    "text_encoder/config.json": {
        "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "d_model": 4096, "d_ff": 10240, "d_kv": 64,
        "num_heads": 64, "num_layers": 24, "vocab_size": 256384, "feed_forward_proj": "gated-gelu",
        "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "is_encoder_decoder": True,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "vae/config.json": {
        "_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0},
    "scheduler/scheduler_config.json": {
        "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "prediction_type": "flow_prediction",
        "use_flow_sigmas": True, "flow_shift": 3.0},
}
"""Wan-AI/Wan2.1-T2V-14B-Diffusers' configs: the 14B video DiT (40 blocks of 40 x 128), umT5-XXL's encoder, the 3-D
causal VAE."""


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
