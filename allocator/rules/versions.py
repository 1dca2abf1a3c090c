"""The releases of the libraries whose rules the planner follows: :data:`ACCELERATE`, the installed accelerate."""

from __future__ import annotations

import importlib.metadata
import re

__all__ = ["ACCELERATE", "release", "accelerate_at_least"]


def release(package: str) -> tuple[int, ...]:
    """The installed release of ``package`` as integers, ``()`` where it is not installed.

    >>> release("a package that is not installed")
    ()
    >>> len(release("accelerate")) >= 2
    True
    """
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ()
    found = []
    for piece in text.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        found.append(int(digits.group()))
    return tuple(found)


ACCELERATE = release("accelerate")
"""The installed accelerate's release. Some loader rules below changed with accelerate 1.16 (a one-device ``"disk"``
map and persistent buffers mapped to disk now load); each rule that changed takes the release as a keyword, this by
default."""


def accelerate_at_least(version: tuple[int, ...], accelerate: tuple[int, ...] | None = None) -> bool:
    """Whether the accelerate release ``accelerate`` (the installed one by default) is ``version`` or later.

    >>> accelerate_at_least((1, 16), (1, 15, 0)), accelerate_at_least((1, 16), (1, 16, 0))
    (False, True)
    """
    return (ACCELERATE if accelerate is None else accelerate) >= version
