"""What several benchmark scripts (and the end-to-end tests) share: CSV output, quiet loads, RAM really held."""

from __future__ import annotations

import csv
import logging
import multiprocessing
import os
import warnings
from pathlib import Path


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` (dicts with the same keys, in order) as a CSV file with a header."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def quiet() -> None:
    """Silence warnings, logging below ERROR and transformers' progress bars for the rest of the process."""
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def ram_held(model) -> int:
    """Bytes of a loaded model's tensors that really are in memory (not on meta), each storage once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total


def cores() -> str:
    """The cores and how busy the machine was when a run started: ``"2 cores (load average 0.4)"``."""
    return f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} over the minute before the run)"


class Worker:
    """A forked child running ``serve(job, conn)``: it sends one answer when loaded (:attr:`loaded`), then one per
    message; an answer ``{"error": ...}`` raises here. ``stop`` is the message that ends it."""

    def __init__(self, serve, job: dict, *, timeout: float, name: str = "worker", stop="stop"):
        ctx = multiprocessing.get_context("fork")
        self.name, self.timeout, self.stop = name, timeout, stop
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(job, child), daemon=True)
        self.proc.start()
        child.close()
        self.loaded = self.receive()

    def receive(self):
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"{self.name}: no answer in {self.timeout} s")
        answer = self.conn.recv()
        if isinstance(answer, dict) and "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer

    def ask(self, message):
        self.conn.send(message)
        return self.receive()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(self.stop)
            except OSError:
                pass
            self.proc.join(self.timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class Contention:
    """``n`` busy processes for the duration of a ``with`` block: a machine shared with other work.

    Each is a pure-Python spin loop in a subprocess of its own, pinned to one core (core ``i`` modulo the cores, where
    the platform pins), so ``Contention(1)`` on 2 cores keeps one of them busy, as another process would. They are
    started on entry and ended on exit (each by its own process object), whatever the block raised; one whose parent
    is killed ends by itself.
    """

    #: spins, and ends by itself once the process that started it is gone (a benchmark killed mid-run)
    SPIN = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
            "    for _ in range(10 ** 6):\n        pass\n")

    def __init__(self, n: int):
        self.n = max(0, int(n))
        self.procs: list = []

    def __enter__(self) -> Contention:
        import subprocess
        import sys

        cores = os.cpu_count() or 1
        for i in range(self.n):
            proc = subprocess.Popen([sys.executable, "-c", self.SPIN])
            if hasattr(os, "sched_setaffinity"):
                try:
                    os.sched_setaffinity(proc.pid, {i % cores})
                except OSError:   # a core this process may not use: left where the kernel puts it
                    pass
            self.procs.append(proc)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except Exception:   # noqa: BLE001 - a spin loop that ignores SIGTERM
                proc.kill()
                proc.wait()
        self.procs = []

    def describe(self) -> str:
        """``"1 busy process (spin loop pinned to core 0)"``, or ``"none"``."""
        if not self.n:
            return "none"
        cores = os.cpu_count() or 1
        pinned = ", ".join(str(i % cores) for i in range(self.n))
        return f"{self.n} busy process{'es' if self.n > 1 else ''} (spin loop pinned to core {pinned})"


def add_contention_arguments(ap, what: str) -> None:
    """``--contention N`` and ``--threads T``, as the runtime benchmarks take them (``what``: what runs beside the
    busy processes)."""
    ap.add_argument("--contention", type=int, default=0, metavar="N",
                    help=f"N busy processes (a Python spin loop each, pinned to core i mod cores) for the duration of "
                         f"{what}")
    ap.add_argument("--threads", type=int, default=None, metavar="T",
                    help="torch's intra-op threads (0: torch's default, one per core); default 1, or torch's default "
                         "with --contention (how users run, where the busy core matters)")
