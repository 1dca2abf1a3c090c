"""Run the examples of a Markdown file and compare what they print with the output shown under them.

An example is a fenced ``python`` block, or a ``bash`` block of ``allocator ...`` command lines, directly followed by a
fenced ``text`` block: its output. The python blocks of a file run in order in one namespace (a later block uses
what an earlier one made), the command lines through :func:`allocator.cli.main`; what they print on stdout must be
the text shown, exactly, or its first lines when the shown text ends with a line ``...``. A block without a text
block after it (``pip install ...``) is not run.

``python tests/readme.py [FILE]`` writes what the examples print now into FILE (default README.md), keeping each
shown text's length where it ends with ``...``; ``tests/test_readme.py`` checks it.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```(python|bash)\n((?:(?!```).)*)```\n(?:[ \t]*\n)*```text\n((?:(?!```).)*)```", re.DOTALL)
MORE = "..."


@dataclass(frozen=True)
class Example:
    kind: str      # "python" or "bash"
    code: str
    shown: str     # the text block's content
    start: int     # where the text block's content starts in the file
    end: int


def examples(text: str) -> list[Example]:
    """The examples of ``text``, in order."""
    return [Example(m.group(1), m.group(2), m.group(3), m.start(3), m.end(3)) for m in BLOCK.finditer(text)]


def run(found: list[Example]) -> list[str]:
    """What each example prints on stdout, in order (python blocks in one namespace)."""
    from allocator import cli

    namespace: dict = {"__name__": "__readme__"}
    out = []
    for example in found:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if example.kind == "python":
                exec(compile(example.code, "<README example>", "exec"), namespace)
            else:
                for line in example.code.splitlines():
                    argv = shlex.split(line, comments=True)
                    if argv[:1] == ["allocator"]:
                        code = cli.main(argv[1:] + ["--quiet"] if argv[1] in ("plan", "fit") else argv[1:])
                        if code != 0:
                            raise AssertionError(f"{line!r} exited with status {code}")
        out.append(buffer.getvalue())
    return out


def matches(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what ``shown`` shows: the same text, or its first lines before a last line ``...``."""
    lines = shown.splitlines()
    if lines and lines[-1] == MORE:
        return printed.splitlines()[: len(lines) - 1] == lines[:-1]
    return printed.rstrip("\n") == shown.rstrip("\n")


def rewrite(text: str, found: list[Example], printed: list[str]) -> str:
    """``text`` with each example's shown output replaced by what it printed (cut where the shown text was)."""
    for example, now in sorted(zip(found, printed), key=lambda pair: -pair[0].start):
        lines = example.shown.splitlines()
        new = now.splitlines()
        if lines and lines[-1] == MORE:
            new = new[: len(lines) - 1] + [MORE]
        text = text[: example.start] + "\n".join(new) + "\n" + text[example.end:]
    return text


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "README.md"
    source = path.read_text()
    found = examples(source)
    path.write_text(rewrite(source, found, run(found)))
    print(f"{len(found)} examples of {path} run, their outputs written")
