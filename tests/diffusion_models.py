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
    return dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), return_dict=False)


def sd3_inputs(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
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
