"""accelerate's ``infer_auto_device_map``, planned by :func:`allocator.plan`: the same arguments, the same dict."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..api import plan
from ..logs import shown
from ..problem import PlanOptions

__all__ = ["as_accelerate_reads", "infer_auto_device_map"]

log = logging.getLogger("allocator")


def as_accelerate_reads(strategy) -> dict:
    """How :func:`infer_auto_device_map` reads the no-split classes for ``strategy``, as :class:`PlanOptions` fields.

    ``"sequential"`` is accelerate's ``infer_auto_device_map`` for the same arguments, and accelerate keeps whole only
    the classes it is given: neither the model's ``_no_split_modules`` nor inferred blocks. Every other strategy reads
    the model as :func:`allocator.plan` does (the given classes united with every sub-model's declared ones).

    Examples
    --------
    >>> as_accelerate_reads("sequential")
    {'discover_no_split': False, 'infer_no_split': False}
    >>> as_accelerate_reads("auto")
    {}
    """
    if strategy == "sequential":
        return {"discover_no_split": False, "infer_no_split": False}
    return {}


def infer_auto_device_map(
    model,
    max_memory: Mapping | None = None,
    no_split_module_classes=None,
    dtype=None,
    special_dtypes=None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    *,
    tied_parameters=None,
    hf_quantizer=None,
    no_placement_params=None,
    strategy="auto",
    objective: str = "contract",
    loader: str = "accelerate",
) -> dict:
    """Drop-in for accelerate's ``infer_auto_device_map``: the same arguments, the same dict shape.

    Its maps are for accelerate's loading path (``loader="accelerate"``: ``dispatch_model``,
    ``load_checkpoint_and_dispatch``), where accelerate's own function sends them; pass ``loader="transformers"`` for a
    map given to ``from_pretrained``.

    ``strategy="sequential"`` returns exactly accelerate's map for the same arguments: like accelerate, it keeps
    whole only the ``no_split_module_classes`` given (none when ``None`` or ``[]``), not the model's declared
    ``_no_split_modules`` (transformers passes those itself). Every other strategy keeps the caller's classes and every
    sub-model's declared ones whole (and, when none is declared, the repeated blocks): :func:`as_accelerate_reads`
    is that one rule. ``verbose`` logs the decisions at INFO on
    the ``allocator`` logger, made visible for the call (:func:`allocator.logs.shown`: to stderr when logging is
    not configured, else to the configured handlers), where accelerate prints them. ``no_placement_params``
    (transformers' argument, names relative to a no-split block) is accepted for signature compatibility;
    :func:`allocator.integrations.transformers.patch` is where it acts.

    Examples
    --------
    accelerate's answer for two 288-byte layers and 400 bytes of RAM: everything on disk, because RAM is the main
    device and keeps 288 bytes free for the largest layer, leaving 112 for the first.

    >>> import torch.nn as nn
    >>> infer_auto_device_map(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {"cpu": 400}, strategy="sequential")
    {'': 'disk'}
    """
    options = PlanOptions(no_split_module_classes=no_split_module_classes, dtype=dtype, special_dtypes=special_dtypes,
                          offload_buffers=offload_buffers, clean_result=clean_result,
                          fallback_allocation=fallback_allocation, tied_parameters=tied_parameters,
                          hf_quantizer=hf_quantizer, objective=objective, loader=loader,
                          **as_accelerate_reads(strategy))
    with shown(verbose):  # the INFO records of this call reach stderr, or the handlers the caller configured
        result = plan(model, max_memory, strategy=strategy, options=options)
        if no_placement_params:
            log.debug("no_placement_params %s are handled by allocator.integrations.transformers.patch, not here",
                      sorted(no_placement_params)[:5])
        if verbose:
            log.info("%s", result.explain())
    return result.device_map
