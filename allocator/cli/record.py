"""``allocator profile-experts``: record how often each routed expert is picked on the user's prompts
(:func:`allocator.profile_experts`) and write the JSON ``allocator plan --runtime allocator --expert-profile FILE``
reads. The model is loaded with its weights (the one command that reads them), through ``allocator.patch()`` so a
model larger than memory loads as ``from_pretrained(device_map="auto")`` would load it under our plan."""

from __future__ import annotations

import os

from ..errors import InvalidModel, InvalidOption, cause_line, one_line
from ..integrations.transformers import patch
from ..model.expert_profile import ExpertProfile, profile_experts
from ..model.families import family_of
from ..model.load import load_model
from .arguments import check_writable, parse_max_memory
from .status import Status

__all__ = ["cmd_profile_experts", "load_tokenizer", "read_prompts", "summary"]

#: The files a saved tokenizer is made of (``tokenizer.save_pretrained``): one of them in a folder means it has one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")


def read_prompts(path: str) -> list[str]:
    """The prompts of ``--prompts``: each non-blank line of the UTF-8 text file ``path``, one prompt.

    Raises
    ------
    InvalidOption
        A file that cannot be read, or that holds no prompt.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            prompts = [line.strip() for line in fh if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidOption(f"--prompts {path}: cannot read it ({one_line(err)}); give a UTF-8 text file with one "
                            "prompt per line.") from None
    if not prompts:
        raise InvalidOption(f"--prompts {path} holds no prompt; write one prompt per line, as your users send them.")
    return prompts


def cmd_profile_experts(args) -> int:
    """Load the model of ``args.source`` with its weights and tokenizer, run it on each prompt (and, with
    ``--max-new-tokens N``, on the N tokens it then generates greedily), and save the routing counts to ``--out``."""
    check_writable(args.out, "--out")
    if args.max_new_tokens < 0:
        raise InvalidOption(f"--max-new-tokens is 0 or more, got {args.max_new_tokens}; e.g. --max-new-tokens 32.")
    prompts = read_prompts(args.prompts)
    max_memory = parse_max_memory(args.max_memory) if args.max_memory is not None else None
    status = Status(enabled=not args.quiet)
    status.say(f"reading {args.source}...")
    loaded = load_model(args.source, trust_remote_code=args.trust_remote_code)
    if not family_of(loaded.model).experts(loaded.model):
        raise InvalidModel(f"{type(loaded.model).__name__} has no mixture-of-experts layer (no experts module with a "
                           "router); there is nothing to profile.")
    tokenizer = load_tokenizer(args.source, args.trust_remote_code)
    status.say(f"loading the weights of {args.source}...")
    hf_logging = _hf_logging()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()   # the status line says what happens; stderr keeps one line per error
    try:
        with patch():
            model = type(loaded.model).from_pretrained(args.source, dtype=loaded.dtype or "auto", device_map="auto",
                                                       max_memory=max_memory,
                                                       trust_remote_code=args.trust_remote_code).eval()
    except (OSError, ValueError) as err:   # no weights, a checkpoint of another model
        raise InvalidModel(f"cannot load the weights of {args.source} ({cause_line(err)}); profile-experts runs the "
                           "model: give a folder saved with save_pretrained, weights included.") from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    status.say(f"running {len(prompts)} prompts...")
    batches = [_tokens(model, tokenizer, text, args.max_new_tokens, args.source) for text in prompts]
    profile = profile_experts(model, batches)
    status.clear()
    profile.save(args.out)
    print(summary(profile, len(prompts)))
    print(f"\nexpert profile written to {args.out}; plan with it: allocator plan {args.source} --runtime allocator "
          f"--expert-profile {args.out}")
    return 0


def _hf_logging():
    from transformers.utils import logging

    return logging


def load_tokenizer(source: str, trust_remote_code: bool = False):
    """The tokenizer saved beside the model in ``source`` (``AutoTokenizer.from_pretrained``).

    Raises
    ------
    InvalidModel
        One line naming the cause (the folder holds no tokenizer files, or transformers' error on the ones it holds,
        in short) and the fix; transformers' whole error is its ``__cause__``.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
        present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))]
        cause = (f"transformers fails on its {', '.join(present)} ({cause_line(err)})" if present else
                 f"the folder holds no tokenizer file ({', '.join(TOKENIZER_FILES[:3])}, ...)")
        raise InvalidModel(f"{source} has no tokenizer transformers can load: {cause}; save the model's tokenizer "
                           f"beside it with tokenizer.save_pretrained({folder!r}).") from err


def _tokens(model, tokenizer, text: str, new_tokens: int, source: str) -> dict:
    """The input of one forward: the prompt's tokens, followed by the ``new_tokens`` the model generates greedily."""
    import torch

    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if not ids.numel():   # transformers builds an empty tokenizer of the config's type where the folder has none
        raise InvalidModel(f"the tokenizer of {source} turns the prompt {text[:40]!r} into no tokens: the folder "
                           f"holds no tokenizer of its own; save the model's tokenizer beside it with "
                           f"tokenizer.save_pretrained({source!r}).")
    if new_tokens:
        with torch.no_grad():
            ids = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0)
    return {"input_ids": ids}


def summary(profile: ExpertProfile, prompts: int) -> str:
    """What was recorded, in two lines: tokens and layers, and how skewed the routing is (the share of the routings
    the most used quarter of each layer's experts took, against a quarter under uniform use).

    >>> print(summary(ExpertProfile({"a": (6, 1, 1, 0), "b": (2, 2, 2, 2)}, tokens=4), 1))
    4 tokens over 1 prompt; 2 mixture-of-experts layers of 4 experts
    the most used quarter of each layer's experts took 25%-75% of its routings (25% if routing were uniform)
    """
    rows = [sorted(row, reverse=True) for row in profile.counts.values() if sum(row)]
    sizes = sorted({len(row) for row in profile.counts.values()})
    shares = [sum(row[:max(1, len(row) // 4)]) / sum(row) for row in rows]
    experts = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}"
    lines = [f"{profile.tokens:,} tokens over {prompts} prompt{'s' if prompts != 1 else ''}; {len(profile.counts)} "
             f"mixture-of-experts layers of {experts} experts"]
    if shares:
        low, high = min(shares), max(shares)
        span = f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%}-{high:.0%}"
        uniform = max(1, sizes[0] // 4) / sizes[0]
        lines.append(f"the most used quarter of each layer's experts took {span} of its routings ({uniform:.0%} if "
                     "routing were uniform)")
    return "\n".join(lines)
