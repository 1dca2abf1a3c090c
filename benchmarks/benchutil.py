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
