"""The README starts with the user: short, Python in its first screen, and every output it shows is what its
examples print now (``tests/readme.py`` runs them; ``python tests/readme.py`` rewrites the outputs)."""

from __future__ import annotations

import pytest

from readme import MORE, ROOT, examples, matches, rewrite, run

README = (ROOT / "README.md").read_text()


def test_the_readme_is_short_and_starts_with_code():
    lines = README.splitlines()
    assert len(lines) <= 210
    first = next(i for i, line in enumerate(lines) if line == "```python")
    assert first < 40, f"the first Python is at line {first + 1}"
    assert "issue #" not in README.lower()  # internal issue numbers mean nothing to a reader


def test_the_examples_are_found():
    found = examples(README)
    kinds = [e.kind for e in found]
    assert kinds.count("python") >= 4 and kinds.count("bash") >= 2
    assert any("allocator.patch()" in e.code for e in found) and any("allocator.fit(" in e.code for e in found)
    assert any(e.code.startswith("allocator fit ") for e in found)


def test_every_shown_output_is_what_the_examples_print():
    found = examples(README)
    printed = run(found)
    wrong = [f"{e.kind} example ({e.code.splitlines()[0]!r}) prints:\n{p}" for e, p in zip(found, printed)
             if not matches(e.shown, p)]
    assert not wrong, "README outputs are stale (run: python tests/readme.py):\n" + "\n".join(wrong)


@pytest.mark.parametrize("shown, printed, ok", [
    ("a\nb\n", "a\nb\n", True),
    ("a\nb\n", "a\nc\n", False),
    (f"a\n{MORE}\n", "a\nb\nc\n", True),
    (f"x\n{MORE}\n", "a\nb\n", False),
])
def test_the_comparison_can_fail(shown, printed, ok):
    assert matches(shown, printed) is ok


def test_rewrite_puts_the_printed_text_in_place():
    text = "```python\nprint(1)\n```\n```text\n2\n```\n"
    found = examples(text)
    assert rewrite(text, found, run(found)) == "```python\nprint(1)\n```\n```text\n1\n```\n"
