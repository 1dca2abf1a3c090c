"""Make the ``allocator`` logger's INFO records visible for one call (``verbose=True``), through ``logging``.

accelerate's ``infer_auto_device_map(verbose=True)`` prints its decisions; ours log them at INFO on the
``allocator`` logger, which nobody configures by default, so ``verbose=True`` would show nothing. :func:`shown`
lowers the logger's level for the call and, when no handler is configured anywhere up the hierarchy, attaches one
that writes the messages to stderr; both are undone afterwards. With logging configured (``logging.basicConfig``,
pytest's ``caplog``), the records go to the configured handlers instead.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

__all__ = ["shown"]


@contextlib.contextmanager
def shown(enabled: bool = True, *, name: str = "allocator", level: int = logging.INFO) -> Iterator[None]:
    """Within the block, records of logger ``name`` at ``level`` and above are emitted (a no-op unless ``enabled``).

    Examples
    --------
    >>> import logging
    >>> with shown():
    ...     logging.getLogger("allocator").info("visible on stderr")
    >>> logging.getLogger("allocator").level  # restored
    0
    """
    if not enabled:
        yield
        return
    logger = logging.getLogger(name)
    previous = logger.level
    handler = None
    if not logger.hasHandlers():  # nobody configured logging: print the messages, as accelerate's verbose does
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
        if handler is not None:
            logger.removeHandler(handler)
