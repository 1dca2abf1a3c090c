"""Command line: ``allocator plan``, ``allocator fit``, ``allocator demo``, ``allocator profile`` and
``allocator profile-experts``.

::

    allocator plan SOURCE [--max-memory 0=20GiB,1=20GiB,cpu=64GiB] [--dtype bf16] [--strategy auto]
                          [--compare] [--explain] [--json FILE|-] [--from-json FILE] [--plot FILE] [--profile FILE]
                          [--inputs input_ids=1x512] [--generation 1,4096] [--optimize prefill|decode]
                          [--runtime accelerate|allocator] [--expert-profile FILE] [--prefetch N]
                          [--expert-cache N]
                          [--trust-remote-code] [--quiet]
    allocator plan --list
    allocator fit SOURCE --max-memory 0=24GiB [--batch-size 1 | --batch --context 8192] [--target 65536]
                         [--margin 0.1] [--limit-positions] [--json FILE|-] [--quiet]
    allocator demo [--model t5-base] [--strategy auto]
    allocator profile [--out FILE] [--folder DIR]
    allocator profile-experts FOLDER --prompts FILE --out FILE [--max-new-tokens N] [--max-memory ...]
                              [--trust-remote-code] [--quiet]
    allocator --version

``profile-experts`` is the one command that reads weights: it loads ``FOLDER`` (saved with ``save_pretrained``, its
tokenizer beside it), runs it on each line of ``--prompts`` and writes the routing counts ``--expert-profile`` reads.

``SOURCE`` is a local model folder holding a ``config.json``, a ``config.json`` path, or a built-in example
(``allocator plan --list``). Models are built from their config on the meta device: nothing is downloaded and no
weights are read. While they are built and planned, a status line on stderr says so when stderr is a terminal
(``--quiet`` silences it).

Bad input exits with status 2 and one line on stderr starting with ``allocator: error:``, never a traceback. A reader
that stops early (``allocator plan ... | head -3``) ends the command quietly, with status 0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import warnings

from .. import __version__
from ..errors import MAX_MESSAGE, AllocatorError, one_line
from ..problem import RUNTIMES
from ..strategies import STRATEGIES
from .commands import cmd_demo, cmd_fit, cmd_plan, cmd_profile
from .record import cmd_profile_experts

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, like every other error of the command."""

    def error(self, message):  # noqa: D102 - argparse's hook
        _fail(f"{message} (see '{self.prog} --help')")
        raise SystemExit(2)


def _fail(message: str) -> int:
    print(f"allocator: error: {one_line(message, 10 * MAX_MESSAGE)}", file=sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    strategies = ", ".join(STRATEGIES)
    parser = _Parser(prog="allocator", description="Plan where each part of a model lives: accelerators, RAM, disk.")
    parser.add_argument("--version", action="version", version=f"allocator {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,fit,demo,profile,profile-experts}")
    p = sub.add_parser("plan", help="plan a model folder, a config.json or a built-in example",
                       description="Plan a model built on the meta device from its config (nothing is downloaded).")
    p.add_argument("source", nargs="?", help="a folder with config.json, a config.json, or a built-in example name")
    p.add_argument("--list", action="store_true", help="list the built-in examples and exit")
    p.add_argument("--max-memory", metavar="DEV=SIZE,...",
                   help="budgets, e.g. 0=20GiB,1=20GiB,cpu=64GiB (default: what this machine has)")
    p.add_argument("--dtype", help="dtype the weights will be loaded in: bfloat16 (bf16), float16 (fp16), float32 "
                   "(fp32), ... (default: the config's)")
    p.add_argument("--strategy", default="auto", metavar="NAME", help=f"one of {strategies} (default: auto)")
    p.add_argument("--objective", default="contract", choices=["contract", "latency"],
                   help="contract (default): GPU 0 first, accelerators in index order, never below accelerate; "
                        "latency: the cost model's estimate alone decides (the CPU may run the model)")
    p.add_argument("--compare", action="store_true", help="also plan with accelerate's algorithm and compare")
    p.add_argument("--explain", action="store_true",
                   help="print why: the main device, what each device holds and why not more, the budget that bound, "
                        "the streaming reserve, the candidate kept and its margin; then the strategy's decisions")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON (schema allocator.plan/3: device map, main "
                   "device, budgets, peaks, estimate, decisions) to FILE, or with '-' to stdout instead of the report")
    p.add_argument("--from-json", metavar="FILE",
                   help="check and show a plan saved with --json against the model, under its saved budgets")
    p.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of bytes per device")
    p.add_argument("--profile", metavar="FILE", help="bandwidths written by 'allocator profile --out FILE'")
    p.add_argument("--inputs", metavar="NAME=DIMxDIM,...",
                   help="shapes of one forward, e.g. input_ids=1x512 or pixel_values=1x3x512x512, or 'default' (the "
                        "config's): FLOPs, ops and activations are counted on the meta device for the cost model")
    p.add_argument("--optimize", default="prefill", choices=["prefill", "decode"],
                   help="the forward objectives price: prefill (default, one forward at --inputs) or decode (one "
                        "decoding step: needs --inputs and --generation)")
    p.add_argument("--generation", metavar="BATCH,MAX_LENGTH[,PROMPT]",
                   help="keep room for generate: KV cache, logits and activations (allocator.GenerationBudget)")
    p.add_argument("--runtime", default="accelerate", choices=RUNTIMES,
                   help="what will run the offloaded weights: accelerate (default: accelerate's hooks, as "
                        "from_pretrained loads) or allocator (allocator.offload, as patch(runtime='allocator') loads: "
                        "routed experts placed one by one, prefetch); prints where each expert and every-token part "
                        "went")
    p.add_argument("--expert-profile", metavar="FILE",
                   help="with --runtime allocator: routing counts saved by allocator.profile_experts(...).save(FILE); "
                        "the most used experts are kept resident (default: uniform use)")
    p.add_argument("--prefetch", type=int, metavar="N",
                   help="with --runtime allocator: offloaded modules made ready ahead (default: the plan decides)")
    p.add_argument("--expert-cache", type=int, metavar="N",
                   help="with --runtime allocator on a mixture of experts: keep the N routed experts used last on the "
                        "main device (slots of the largest expert, part of its peak; default: 0, no cache)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the model folder's own code, for a config whose auto_map names it")
    p.add_argument("--quiet", action="store_true", help="no status line on stderr while the model is built and planned")
    t = sub.add_parser("fit", help="the longest context (or largest batch) with the whole model on the accelerators",
                       description="The longest context that keeps the whole model, its KV cache, logits and "
                                   "activations on the accelerators; then, with --target, the plan that offloads for "
                                   "a longer one.")
    t.add_argument("source", help="a folder with config.json, a config.json, or a built-in example name")
    t.add_argument("--max-memory", metavar="DEV=SIZE,...", required=True, help="budgets, e.g. 0=24GiB,cpu=64GiB")
    t.add_argument("--dtype", help="dtype the weights will be loaded in: bfloat16 (bf16), float16 (fp16), ... "
                   "(default: the config's)")
    t.add_argument("--batch-size", type=int, default=1, metavar="N", help="sequences generated together (default 1)")
    t.add_argument("--batch", action="store_true", help="search the largest batch at --context instead")
    t.add_argument("--context", type=int, metavar="TOKENS", help="the context (max_length) --batch searches at")
    t.add_argument("--target", type=int, metavar="N", help="a longer context (a larger batch with --batch) wanted "
                   "anyway: show the plan that offloads for it")
    t.add_argument("--margin", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of each budget kept free (default 0), e.g. 0.1")
    t.add_argument("--limit-positions", action="store_true",
                   help="stop at the model's positions (config max_position_embeddings)")
    t.add_argument("--strategy", default="auto", metavar="NAME", help=f"one of {strategies} (default: auto)")
    t.add_argument("--runtime", default="accelerate", choices=RUNTIMES,
                   help="the runtime --target's plan is for; with allocator, also the longest context with every "
                        "layer's attention and KV cache on the first accelerator and the rest in RAM")
    t.add_argument("--json", metavar="FILE", help="write the answer and its plans as JSON to FILE, or '-' for stdout")
    t.add_argument("--trust-remote-code", action="store_true", help="let transformers run the folder's own code")
    t.add_argument("--quiet", action="store_true", help="no status line on stderr")
    d = sub.add_parser("demo", help="accelerate vs allocator on a built-in example under three budgets")
    d.add_argument("--model", default="t5-base", help="a built-in example (default: t5-base)")
    d.add_argument("--strategy", default="auto", metavar="NAME", help=f"one of {strategies} (default: auto)")
    f = sub.add_parser("profile", help="measure this machine's bandwidths")
    f.add_argument("--out", metavar="FILE", help="write them as JSON for 'allocator plan --profile FILE'")
    f.add_argument("--folder", metavar="DIR",
                   help="where the disk test file is written (default: the temporary folder); use the disk that "
                        "will hold offloaded weights")
    e = sub.add_parser("profile-experts", help="record how often each routed expert is picked on your prompts",
                       description="Load a mixture-of-experts model folder with its weights and tokenizer, run it on "
                                   "each line of --prompts, and write the routing counts that 'allocator plan "
                                   "--runtime allocator --expert-profile FILE' reads (allocator.profile_experts).")
    e.add_argument("source", metavar="FOLDER", help="a folder saved with save_pretrained, weights and tokenizer")
    e.add_argument("--prompts", metavar="FILE", required=True, help="a UTF-8 text file, one prompt per line")
    e.add_argument("--out", metavar="FILE", required=True, help="where the expert profile is written (JSON)")
    e.add_argument("--max-new-tokens", type=int, default=0, metavar="N",
                   help="also count the routing of N tokens generated greedily after each prompt (default 0)")
    e.add_argument("--max-memory", metavar="DEV=SIZE,...",
                   help="budgets the model is loaded under (device_map='auto' with allocator's plan; default: what "
                        "this machine has)")
    e.add_argument("--trust-remote-code", action="store_true", help="let transformers run the folder's own code")
    e.add_argument("--quiet", action="store_true", help="no status line on stderr")
    return parser


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0, or 2 on bad input with one line on stderr)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    commands = {"plan": cmd_plan, "fit": cmd_fit, "demo": cmd_demo, "profile": cmd_profile,
                "profile-experts": cmd_profile_experts}
    # The report states violations itself: keep the library's warnings about them off stderr, without touching
    # the caller's logging configuration (main also runs inside notebooks and tests).
    library = logging.getLogger("allocator")
    level = library.level
    library.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # restores showwarning after
            warnings.showwarning = functools.partial(_show_warning, set())
            code = commands[args.command](args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (AllocatorError, OSError) as err:  # every AllocatorError is a ValueError; typed and worded for users
        return _fail(str(err))
    except KeyboardInterrupt:
        print("allocator: interrupted", file=sys.stderr)
        return 130
    finally:
        library.setLevel(level)


def _show_warning(shown: set, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, like the errors (``allocator: warning: max_memory['cpu'] = 64 is read as 64 bytes...``),
    once per command: budgets are read twice (checked before the model is built, then planned)."""
    text = f"allocator: warning: {one_line(message, 10 * MAX_MESSAGE)}"
    if text not in shown:
        shown.add(text)
        print(text, file=sys.stderr)


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``allocator plan ... | head -3``): stop quietly, with status 0.

    What is still buffered would fail again when the interpreter flushes stdout at exit (printing "Exception ignored
    ... BrokenPipeError" on stderr), so stdout is pointed at the null device first, as the Python docs advise.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a notebook's, a test's)
        pass
    return 0
