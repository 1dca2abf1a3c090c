"""A diffusion pipeline's components on the meta device, read from ``model_index.json`` and each component's config
(nothing downloaded, no weights read), or taken from a loaded pipeline; and how often each one runs per image."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidModel, cause_line
from ..model.families import family_of
from ..model.zoo import move_strays_to_meta, quiet_transformers

__all__ = ["Component", "DENOISERS", "pipeline_class", "read_components", "runs_per_image"]

DENOISERS = ("transformer", "transformer_2", "unet", "prior", "decoder")
"""Component names of the denoiser in diffusers' pipelines: it runs once per denoising step."""


@dataclass(frozen=True, slots=True)
class Component:
    """One ``torch.nn.Module`` component of a pipeline.

    Attributes
    ----------
    name : str
        Its name in ``model_index.json`` (``"transformer"``, ``"text_encoder_2"``, ``"vae"``).
    model : torch.nn.Module
        Built on the meta device (or the pipeline's own module).
    library : str
        ``"diffusers"`` or ``"transformers"``: whose ``from_pretrained`` loads it, so whose loading rules its map
        follows (diffusers: ``loader="accelerate"``, see :mod:`allocator.integrations.diffusers`).
    """

    name: str
    model: object
    library: str

    @property
    def loader(self) -> str:
        """The loading rules its map follows: its family's (:func:`allocator.model.family_of`), else accelerate's
        (diffusers loads a component of no known family through accelerate's ``dispatch_model``)."""
        return family_of(self.model).loader or "accelerate"


def runs_per_image(name: str, *, steps: int, prompts: int = 1, images: int = 1) -> float:
    """How many times component ``name`` runs per image: the denoiser once per step, a text encoder once per prompt,
    the VAE (and anything else) once per image.

    >>> runs_per_image("transformer", steps=28), runs_per_image("text_encoder_2", steps=28, images=4)
    (28.0, 0.25)
    """
    if name in DENOISERS:
        return float(steps)
    if name.startswith(("text_encoder", "image_encoder")):
        return prompts / images
    return 1.0


def pipeline_class(source) -> str | None:
    """The pipeline's class name: ``_class_name`` of a folder's ``model_index.json``, or a loaded pipeline's type;
    ``None`` where neither says."""
    if not isinstance(source, (str, os.PathLike)):
        return type(source).__name__
    try:
        with open(os.path.join(source, "model_index.json")) as f:
            name = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def read_components(source) -> dict[str, Component]:
    """The ``torch.nn.Module`` components of ``source``: a pipeline folder (``model_index.json`` and a config per
    component) built on the meta device, or a loaded pipeline (``pipeline.components``). Tokenizers, schedulers and
    other non-module components are left out (they hold no weights).

    Raises
    ------
    InvalidModel
        No ``model_index.json``, a component class that neither diffusers nor transformers defines, or a config its
        class cannot build.
    """
    import torch

    if not isinstance(source, (str, os.PathLike)):
        found = getattr(source, "components", None)
        if not isinstance(found, Mapping):
            raise InvalidModel(f"{type(source).__name__} is neither a pipeline folder nor a DiffusionPipeline; pass "
                               "a folder with model_index.json or a loaded pipeline.")
        return {name: Component(name, module, type(module).__module__.split(".")[0])
                for name, module in found.items() if isinstance(module, torch.nn.Module)}
    index_path = os.path.join(source, "model_index.json")
    if not os.path.isfile(index_path):
        raise InvalidModel(f"{source} has no model_index.json; pass a pipeline folder saved by save_pretrained.")
    with open(index_path) as f:
        index = json.load(f)
    components = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or None in entry:
            continue
        library, class_name = entry
        cls = _class(library, class_name, name)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            components[name] = Component(name, _build(cls, library, os.path.join(source, name)), library)
    return components


def _class(library: str, class_name: str, name: str):
    try:
        return getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        raise InvalidModel(f"component {name!r}: {library}.{class_name} is not importable; install {library} "
                           "(pip install 'allocator[diffusers]').") from None


def _build(cls, library: str, folder: str):
    import torch

    try:
        with quiet_transformers(), torch.device("meta"):
            if library == "transformers":
                import transformers

                config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
                model = cls(config)
            else:
                model = cls.from_config(cls.load_config(folder, local_files_only=True))
    except Exception as err:   # a config's own checks raise anything
        raise InvalidModel(f"cannot build {cls.__name__} from {folder}: {cause_line(err)}; fix the config's fields "
                           "it names.") from err
    move_strays_to_meta(model)
    return model.eval()
