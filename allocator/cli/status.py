"""A status line on stderr while the command works ("building llama-8b on the meta device..."), shown only where
someone watches: stderr is a terminal and ``--quiet`` is not given. Each message replaces the last; the line is
erased before the report is printed, so nothing of it stays in the terminal or reaches a file or a pipe."""

from __future__ import annotations

import sys

__all__ = ["Status"]


class Status:
    """Messages on one line of ``stream`` (stderr by default), when ``enabled`` and the stream is a terminal.

    Examples
    --------
    >>> import io
    >>> status = Status(enabled=True, stream=io.StringIO())  # not a terminal: says nothing
    >>> status.say("planning"); status.clear(); status.stream.getvalue()
    ''
    """

    def __init__(self, *, enabled: bool = True, stream=None):
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.shown = bool(enabled and callable(isatty) and isatty())
        self._width = 0

    def say(self, message: str) -> None:
        """Replace the line with ``message``."""
        if not self.shown:
            return
        text = f"allocator: {message}"
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)

    def clear(self) -> None:
        """Erase the line (before the report is printed)."""
        if self.shown and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
