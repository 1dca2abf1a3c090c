"""Distributed training and inference from the discovered structure: FSDP wrapping and pipeline splits.

The same blocks that placement keeps whole are the natural units of the two ways of spreading a model over
processes: FSDP shards and gathers one block at a time, and a pipeline cuts the model between blocks.

:func:`block_classes`
    The block classes of a model, as classes found in it (declared no-split classes, else inferred blocks).
:func:`fsdp_wrap_policy`
    FSDP1's ``ModuleWrapPolicy`` over those classes.
:func:`apply_fully_shard`
    FSDP2: ``fully_shard`` on every block, then on the root.
:func:`pipeline_split_spec`
    A balanced contiguous split of the blocks into pipeline stages, as the ``split_spec`` that
    ``torch.distributed.pipelining.pipeline`` takes.
:func:`contiguous_min_max`
    The exact partitioner behind it: cut a sequence into contiguous parts minimising the largest part.

Glossary
--------
block
    A module of a block class (see :mod:`allocator.model.blocks`); in a pipeline split, one of the blocks of
    :func:`allocator.model.blocks.find_layers`, in definition order.
stage
    A contiguous run of blocks executed by one pipeline rank.
charged bytes
    The bytes a split attributes to a block: its own tensors, plus the tensors defined between it and the next
    block (or after the last block); the tensors defined before the first block are charged to the first block.

FSDP lives in :mod:`allocator.parallel.fsdp`, the pipeline split in :mod:`allocator.parallel.pipeline`; this package
re-exports their public names.
"""

from __future__ import annotations

from .fsdp import apply_fully_shard, block_classes, fsdp_wrap_policy
from .pipeline import PipelineSplit, contiguous_min_max, pipeline_split_spec

__all__ = [
    "PipelineSplit",
    "apply_fully_shard",
    "block_classes",
    "contiguous_min_max",
    "fsdp_wrap_policy",
    "pipeline_split_spec",
]
