"""How the runtime runs the offloaded routed experts of a layer in a call: as the plan decided for the call's phase
(``Runtime.expert_mode``: ``"fetch"`` or ``"compute"`` per experts layer and phase), never re-derived; ``"auto"``
(only where the caller asks for it) chooses per expert by the plan's own formula
(:func:`allocator.evaluate.experts.expert_seconds`).

The functions take an :class:`allocator.offload.experts.RoutedExperts` (its ``metas``, ``layer``, ``profile``,
``home``, ``where``, ``remote`` and ``accelerator``).
"""

from __future__ import annotations

from ..evaluate.experts import expert_seconds

__all__ = ["computes_here", "computes_there", "phase_mode"]


def phase_mode(mode, threshold: int, tokens: int) -> tuple[str, str]:
    """``(phase, mode)`` of a call routing ``tokens`` tokens: ``"decode"`` for at most ``threshold`` tokens
    (``Runtime.threshold``), else ``"prefill"``; the mode written for that phase (``mode``: one for every phase, or
    ``{phase: mode}``), ``"auto"`` where none is.

    >>> phase_mode({"prefill": "fetch", "decode": "compute"}, 1, 12)
    ('prefill', 'fetch')
    >>> phase_mode("fetch", 4, 4)
    ('decode', 'fetch')
    """
    phase = "decode" if tokens <= threshold else "prefill"
    return phase, mode if isinstance(mode, str) else mode.get(phase, "auto")   # str first: no ABC check per call


def _seconds(routed, lives, tokens: int) -> tuple[float, float]:
    """One expert of ``routed`` living on ``lives`` with ``tokens`` routed to it: ``(fetched, computed where it
    lives)`` seconds by the plan's formula."""
    metas = routed.metas
    size = sum(m[0].numel() * m.element_size() for m in metas.values())
    numel = sum(m[0].numel() for m in metas.values())
    token_bytes = routed.layer.hidden * next(iter(metas.values())).element_size()
    return expert_seconds(routed.profile, lives, "main" if routed.home is None else routed.home, size, len(metas),
                          numel, tokens, token_bytes)


def computes_here(routed, expert: int, tokens: int, mode: str) -> bool:
    """Whether offloaded ``expert`` with ``tokens`` routed to it runs on the CPU where its weights live rather than
    being fetched: only from RAM to an accelerator; as ``mode`` says (by the cheaper estimate under ``"auto"``)."""
    if not routed.accelerator or routed.where[expert] != "cpu" or mode == "fetch":
        return False
    if mode == "compute":
        return True
    fetched, local = _seconds(routed, "cpu", tokens)
    return local < fetched


def computes_there(routed, expert: int, tokens: int, mode: str) -> bool:
    """Whether ``expert``, resident on another accelerator, with ``tokens`` routed to it runs there (its activations
    moved) rather than being fetched to its layer's device: as ``mode`` says (by the cheaper estimate under
    ``"auto"``)."""
    if mode != "auto":
        return mode == "compute"
    fetched, local = _seconds(routed, routed.remote[expert][0], tokens)
    return local < fetched
