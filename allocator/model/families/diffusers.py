"""diffusers' ``ModelMixin`` (a UNet, a transformer denoiser, a VAE): ``_no_split_modules`` as transformers declares
them, no token generation, and the loading rules of accelerate's ``load_checkpoint_and_dispatch``
(``loader="accelerate"``): ``ModelMixin.from_pretrained`` writes disk tensors with accelerate's ``offload_weight``
and calls ``dispatch_model``, ties nothing after loading (:mod:`allocator.integrations.diffusers` says how that was
checked).
"""

from __future__ import annotations

import sys

from .family import Family

__all__ = ["DIFFUSERS", "is_model_mixin"]


def is_model_mixin(model) -> bool:
    """Whether ``model`` is a diffusers ``ModelMixin``. Imports nothing: one exists only once
    ``diffusers.models.modeling_utils`` is imported.

    >>> import torch.nn as nn
    >>> is_model_mixin(nn.Linear(2, 2))
    False
    """
    modeling = sys.modules.get("diffusers.models.modeling_utils")
    base = getattr(modeling, "ModelMixin", None)
    return base is not None and isinstance(model, base)


DIFFUSERS = Family("diffusers", matches=is_model_mixin, cache_layers=None, loader="accelerate")
"""diffusers' models (``ModelMixin``): they denoise or decode images, they do not generate tokens."""
