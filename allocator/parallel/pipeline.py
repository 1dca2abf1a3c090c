"""Pipeline splits: the model's blocks cut into balanced contiguous stages, and the exact partitioner behind it.

:func:`pipeline_split_spec`
    A balanced contiguous split of the blocks into pipeline stages (a :class:`PipelineSplit`), as the
    ``split_spec`` that ``torch.distributed.pipelining.pipeline`` takes.
:func:`contiguous_min_max`
    The exact partitioner behind it: cut a sequence into contiguous parts minimising the largest part.

Glossary
--------
block
    One of the blocks of :func:`allocator.model.blocks.find_layers`, in definition order.
stage
    A contiguous run of blocks executed by one pipeline rank.
charged bytes
    The bytes a split attributes to a block: its own tensors, plus the tensors defined between it and the next
    block (or after the last block); the tensors defined before the first block are charged to the first block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch.nn as nn

from ..budgets import format_bytes, parse_size
from ..errors import InfeasiblePlacement, InvalidModel, InvalidOption
from ..model import build_graph
from ..model.blocks import find_layers, require_module
from ..search.partition import least_feasible, parts, split

__all__ = ["PipelineSplit", "contiguous_min_max", "pipeline_split_spec"]


def contiguous_min_max(sizes: Sequence[int], n: int, *, capacities: Sequence[int | None] | None = None) -> list[int]:
    """Cut ``sizes`` into ``n`` contiguous non-empty parts minimising the largest part's sum.

    Parameters
    ----------
    sizes : sequence of int
        Non-negative item sizes (bytes), in order.
    n : int
        Number of parts, ``1 <= n <= len(sizes)``.
    capacities : sequence of (int or None), optional
        ``n`` upper bounds, one per part in order (``None``: unbounded); part ``j``'s sum must not exceed
        ``capacities[j]``.

    Returns
    -------
    list of int
        The ``n - 1`` cut indices ``c``, increasing: part ``j`` is ``sizes[c[j - 1]:c[j]]`` with ``c[-1] = 0``
        and ``c[n - 1] = len(sizes)`` implied.

    Raises
    ------
    InvalidOption
        Negative or non-integer sizes, ``n`` outside ``[1, len(sizes)]``, or ``len(capacities) != n``.
    InfeasiblePlacement
        No split respects ``capacities``; ``minimum`` is the optimum without them (each split has a part at
        least that large).

    Notes
    -----
    Optimal: the largest part sum is the minimum over all splits into ``n`` contiguous non-empty parts that
    respect ``capacities``. Among optimal splits, the one returned has its last part as short as possible,
    then the part before it, and so on (cuts as late as possible, last first): deterministic.

    Method: binary search on the integer bottleneck ``B`` in ``[max(max(sizes), ceil(sum / n)), sum]``. For a
    given ``B`` the positions reachable by ``j`` parts, each within ``min(B, capacities[j])``, are computed
    from those reachable by ``j - 1`` with a two-pointer sweep over the prefix sums; ``B`` is feasible iff
    ``len(sizes)`` is reachable by ``n`` parts (:func:`allocator.search.partition.split`, shared with the
    ``balanced`` strategy). This is exact where a greedy fill is not (with capacities, or when a part must be left an
    item).

    Complexity: O(n · N · log S) time and O(n · N) memory, for ``N = len(sizes)`` and ``S = sum(sizes)``.

    Examples
    --------
    >>> contiguous_min_max([5, 1, 1, 1, 1, 5], 3)
    [1, 5]
    >>> contiguous_min_max([4, 4, 4, 4], 2, capacities=[4, None])
    [1]
    """
    sizes = _check_sizes(sizes)
    if isinstance(n, bool) or not isinstance(n, Integral) or not 1 <= n <= len(sizes):
        raise InvalidOption(f"n must be an int in [1, {len(sizes)}] (one item at least per part), got {n!r}.")
    caps = _check_capacities(capacities, n)
    total = sum(sizes)
    lo, hi = max(max(sizes), -(-total // n)), total
    best = least_feasible(lambda bound: split(sizes, [_limit(bound, c) for c in caps]) is not None, lo, hi)
    if best is None:
        worst = _bottleneck(sizes, contiguous_min_max(sizes, n))
        raise InfeasiblePlacement(
            f"no split of the {len(sizes)} items into {n} contiguous parts fits capacities {list(capacities)}; "
            f"every split has a part of at least {worst}: raise the capacities to at least that.",
            minimum=worst,
        )
    return split(sizes, [_limit(best, c) for c in caps])


def _limit(bound: int, capacity: int | None) -> int:
    return bound if capacity is None else min(bound, capacity)


def _bottleneck(sizes: Sequence[int], cuts: Sequence[int]) -> int:
    return max(sum(sizes[r.start:r.stop]) for r in parts(cuts, len(sizes)))


def _check_sizes(sizes) -> list[int]:
    out = list(sizes)
    if not out:
        raise InvalidOption("sizes is empty: there is nothing to split.")
    for s in out:
        if isinstance(s, bool) or not isinstance(s, Integral) or s < 0:
            raise InvalidOption(f"sizes must be non-negative ints (bytes), got {s!r}.")
    return [int(s) for s in out]


def _check_capacities(capacities, n: int) -> list[int | None]:
    if capacities is None:
        return [None] * n
    caps = list(capacities)
    if len(caps) != n:
        raise InvalidOption(f"capacities must give one bound per part: {n} expected, got {len(caps)}.")
    for c in caps:
        if c is not None and (isinstance(c, bool) or not isinstance(c, Integral) or c < 0):
            raise InvalidOption(f"capacities must be non-negative ints or None, got {c!r}.")
    return caps


@dataclass(frozen=True, slots=True)
class PipelineSplit:
    """A split of a model's blocks into pipeline stages, from :func:`pipeline_split_spec`."""

    split_spec: dict
    """``{block name: SplitPoint.BEGINNING}`` for the first block of stages 1 to n - 1: the ``split_spec`` of
    ``torch.distributed.pipelining.pipeline``."""
    stages: tuple[tuple[str, ...], ...]
    """Block names of each stage, in order; every block once."""
    stage_bytes: tuple[int, ...]
    """Charged bytes of each stage: its blocks', the parts before the first block on stage 0 and after the last
    block on the last stage."""
    block_bytes: tuple[int, ...]
    """Charged bytes of each block (see the module's glossary), in block order."""
    stage_budgets: tuple[int, ...] | None = None
    """The budgets the split was asked to fit, in bytes, if any."""
    model_class: str = ""

    @property
    def largest(self) -> int:
        """Bytes of the largest stage: what the split minimises."""
        return max(self.stage_bytes)

    def explain(self) -> str:
        """The split as text: per stage, its blocks and bytes (against its budget when one was given).

        >>> from allocator.parallel import PipelineSplit
        >>> print(PipelineSplit({"b.1": "BEGINNING"}, (("b.0",), ("b.1", "b.2")), (3072, 2048), (3072, 1024, 1024),
        ...                     model_class="Net").explain())
        Net: 3 blocks in 2 stages; largest stage 3.00 KiB (an even split would be 2.50 KiB)
          stage 0: b.0 (1 block), 3.00 KiB, with what precedes the first block
          stage 1: b.1 .. b.2 (2 blocks), 2.00 KiB, with what follows the last block
        """
        n = len(self.stages)
        even = sum(self.stage_bytes) / n
        lines = [f"{self.model_class or 'model'}: {len(self.block_bytes)} blocks in {n} stages; largest stage "
                 f"{format_bytes(self.largest)} (an even split would be {format_bytes(even)})"]
        for j, (blocks, nbytes) in enumerate(zip(self.stages, self.stage_bytes)):
            span = blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]}"
            line = f"  stage {j}: {span} ({len(blocks)} block{'s' * (len(blocks) > 1)}), {format_bytes(nbytes)}"
            if self.stage_budgets is not None:
                budget = self.stage_budgets[j]
                line += f" of {format_bytes(budget)}" + (f" ({nbytes / budget:.0%})" if budget else "")
            if j == 0:
                line += ", with what precedes the first block"
            if j == n - 1:
                line += ", with what follows the last block" if n > 1 else " and what follows the last"
            lines.append(line)
        return "\n".join(lines)


def pipeline_split_spec(model: nn.Module, n_stages: int, *, stage_budgets=None, dtype=None) -> PipelineSplit:
    """A balanced split of the model's blocks into ``n_stages`` contiguous pipeline stages.

    Parameters
    ----------
    model : torch.nn.Module
        Only read; meta-device models work. The split is made of the blocks of
        :func:`allocator.model.blocks.find_layers`, every stack's in turn, in definition order.
    n_stages : int
        Between 1 and the number of blocks: a stage holds one block at least.
    stage_budgets : sequence of (int or str), optional
        One budget per stage (bytes, or a size such as ``"2GiB"``); each stage's bytes must fit its budget.
    dtype : torch.dtype or str, optional
        Count floating tensors at this dtype, as :func:`allocator.model.build_graph` does (the model's own
        dtypes when omitted).

    Returns
    -------
    PipelineSplit
        ``.split_spec`` for ``torch.distributed.pipelining.pipeline``, ``.stages``, ``.stage_bytes`` and
        ``.explain()``.

    Raises
    ------
    InvalidModel
        ``model`` is not an ``nn.Module`` or has no repeated blocks.
    InvalidOption
        ``n_stages`` is not in ``[1, number of blocks]``, or ``stage_budgets`` does not give ``n_stages`` sizes.
    InfeasiblePlacement
        No split fits ``stage_budgets``; ``minimum`` is the largest stage of the best split without budgets,
        which every split reaches on some stage and which suffices as every stage's budget.

    Notes
    -----
    Sizes are the tensors of :func:`allocator.model.build_graph`. Each block is charged its own tensors and
    those defined after it up to the next block (what runs between two blocks stays with the first, as
    ``SplitPoint.BEGINNING`` on the next block cuts); the tensors defined before the first block are charged
    to it. So the embeddings go to stage 0, the final norm and head to the last stage. Definition order is
    used, not execution order: a module defined after the layers but run before them (llama's ``rotary_emb``,
    a few bytes of buffers) is charged to the last stage.

    A tensor shared by several blocks' charges (a head tied to the input embeddings) is charged to each, as a
    pipeline replicates it on every stage that uses it; within one block it counts once.

    The split minimises the largest stage's bytes exactly (:func:`contiguous_min_max`). Complexity:
    O(modules + tensors) to charge the blocks, then O(n · N · log S) for ``N`` blocks of ``S`` bytes.

    Examples
    --------
    >>> import torch.nn as nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = nn.Embedding(64, 16)
    ...         self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
    ...         self.head = nn.Linear(16, 64, bias=False)
    >>> split = pipeline_split_spec(Net(), 2)
    >>> split.stages
    (('layers.0', 'layers.1'), ('layers.2', 'layers.3'))
    >>> split.split_spec
    {'layers.2': <SplitPoint.BEGINNING: 1>}
    >>> split.stage_bytes
    (6272, 6272)
    """
    from torch.distributed.pipelining import SplitPoint

    require_module(model, "pipeline_split_spec")
    blocks = [name for _, names in find_layers(model) for name in names]
    if not blocks:
        raise InvalidModel(
            f"{type(model).__name__} has no repeated blocks to split between stages; use "
            "torch.distributed.pipelining.pipe_split() in its forward instead."
        )
    if isinstance(n_stages, bool) or not isinstance(n_stages, Integral) or not 1 <= n_stages <= len(blocks):
        raise InvalidOption(
            f"n_stages must be an int in [1, {len(blocks)}]: {type(model).__name__} has {len(blocks)} blocks and a "
            f"stage holds one at least; got {n_stages!r}."
        )
    budgets = _stage_budgets(stage_budgets, n_stages)
    charged = _charge_blocks(model, blocks, dtype)
    best = contiguous_min_max(charged, n_stages)
    cuts = best
    if budgets is not None:
        try:
            cuts = contiguous_min_max(charged, n_stages, capacities=budgets)
        except InfeasiblePlacement:
            minimum = _bottleneck(charged, best)
            raise InfeasiblePlacement(
                f"no split of the {len(blocks)} blocks of {type(model).__name__} into {n_stages} stages fits "
                f"stage_budgets [{', '.join(format_bytes(b) for b in budgets)}]: every split has a stage of at least "
                f"{format_bytes(minimum)} ({minimum} B). Give each stage at least {minimum} B, or use more stages.",
                minimum=minimum,
            ) from None
    stages = parts(cuts, len(blocks))
    return PipelineSplit(
        split_spec={blocks[c]: SplitPoint.BEGINNING for c in cuts},
        stages=tuple(tuple(blocks[r.start:r.stop]) for r in stages),
        stage_bytes=tuple(sum(charged[r.start:r.stop]) for r in stages),
        block_bytes=tuple(charged),
        stage_budgets=budgets,
        model_class=type(model).__name__,
    )


def _stage_budgets(stage_budgets, n_stages: int) -> tuple[int, ...] | None:
    if stage_budgets is None:
        return None
    if isinstance(stage_budgets, (str, bytes)) or not isinstance(stage_budgets, Sequence):
        raise InvalidOption(
            f"stage_budgets must be a sequence of {n_stages} sizes such as ['2GiB', '2GiB'], got {stage_budgets!r}."
        )
    if len(stage_budgets) != n_stages:
        raise InvalidOption(
            f"stage_budgets must give one size per stage: {n_stages} expected, got {len(stage_budgets)}."
        )
    return tuple(parse_size(b, what=f"stage_budgets[{j}]") for j, b in enumerate(stage_budgets))


def _charge_blocks(model: nn.Module, blocks: list[str], dtype) -> list[int]:
    """Charged bytes of each block (see the module's glossary), from the model graph's tensors."""
    graph = build_graph(model, dtype=dtype)
    position = {graph.node_index[name]: i for i, name in enumerate(blocks)}
    block_of = [-1] * len(graph.nodes)  # the block holding each node, -1 outside blocks
    for i, parent in enumerate(graph.nodes.parent):  # preorder: a parent before its children
        block_of[i] = position.get(i, block_of[parent] if parent >= 0 else -1)
    charged = [0] * len(blocks)
    seen: list[set[int]] = [set() for _ in blocks]
    last = 0  # the block that tensors outside blocks are charged to: the latest block defined before them
    tensors = graph.tensors
    for module, storage, nbytes in zip(tensors.module, tensors.storage, tensors.nbytes):  # definition order
        owner = block_of[module]
        if owner >= 0:
            last = owner
        target = owner if owner >= 0 else last
        if storage not in seen[target]:
            seen[target].add(storage)
            charged[target] += nbytes
    return charged
