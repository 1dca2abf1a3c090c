"""Every notebook in ``notebooks/`` runs top to bottom without an error, in a kernel on this interpreter.

The kernel is the ``python3`` spec written into a temporary ``JUPYTER_PATH`` with ``sys.executable``, so the test
uses this venv whatever kernelspecs the user has installed (or none, in a fresh ``make test`` venv).

``python tests/test_notebooks.py --update [NAME ...]`` executes the notebooks and saves them with their outputs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
TIMEOUT = 300  # per cell, seconds
PROBE = "import sys; print(sys.executable)"


def kernel_env(root: Path) -> dict:
    """Environment variables that pin the ``python3`` kernel to this interpreter and keep Jupyter/IPython state
    (runtime files, profiles, startup scripts) inside ``root``."""
    spec = root / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (allocator tests)", "language": "python",
    }))
    return {"JUPYTER_PATH": str(root / "jupyter"), "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
            "IPYTHONDIR": str(root / "ipython"), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}


def execute(path: Path, workdir: Path, allow_errors: bool = False):
    """Run the notebook at ``path`` in ``workdir``; returns it with outputs. Raises on any cell error (unless
    ``allow_errors``: then every cell runs and the errors are in the outputs), or when the kernel does not run
    ``sys.executable``."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT, record_timing=False,
                                     allow_errors=allow_errors, resources={"metadata": {"path": str(workdir)}})
    client.execute()
    probe = nb.cells.pop()
    executable = "".join(o.get("text", "") for o in probe.outputs).strip()
    if os.path.realpath(executable) != os.path.realpath(sys.executable):
        raise RuntimeError(f"the kernel ran {executable!r}, not {sys.executable!r}")
    return nb


def test_the_kernel_spec_is_this_interpreter(tmp_path, monkeypatch):
    from jupyter_client.kernelspec import KernelSpecManager

    for key, value in kernel_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    for key, value in kernel_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    work = tmp_path / "work"
    work.mkdir()
    nb = execute(path, work, allow_errors=True)  # every cell runs; the errors are checked here, not by nbclient
    errors = [f"cell {i}: {o.ename}: {o.evalue}" for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for o in cell.outputs if o.output_type == "error"]
    assert not errors, "\n".join(errors)
    assert all(cell.execution_count for cell in nb.cells if cell.cell_type == "code" and cell.source.strip())


def _update(names) -> None:
    import tempfile

    for path in NOTEBOOKS:
        if names and path.stem not in names and path.name not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            os.environ.update(kernel_env(Path(tmp)))
            (Path(tmp) / "work").mkdir()
            nb = execute(path, Path(tmp) / "work")
        nbformat.write(nb, path)
        print(f"executed and saved {path}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--update"]:
        sys.exit("usage: python tests/test_notebooks.py --update [NAME ...]")
    _update(sys.argv[2:])
