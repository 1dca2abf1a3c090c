"""Parsers of the command line's values: ``--max-memory``, ``--generation``, ``--inputs``, ``--dtype``, output
paths. Each raises a typed error (:mod:`allocator.errors`) whose message says the fix."""

from __future__ import annotations

import os

from ..budgets import parse_budgets, small_bare_number
from ..errors import InvalidBudget, InvalidOption, one_line, warn_caller
from ..model.expert_profile import ExpertProfile
from ..model.families import family_of
from ..model.generation import GenerationBudget
from ..problem import absent_accelerators
from ..profile import Profile

__all__ = ["check_expert_cache", "parse_generation", "parse_inputs", "parse_max_memory", "load_profile",
           "load_expert_profile", "check_writable", "warn_absent_accelerators"]


def parse_generation(text: str):
    """``"4,2048"`` or ``"4,2048,1024"`` -> ``GenerationBudget(4, 2048, prompt_length=1024)``, checked.

    >>> parse_generation("4,2048,1024")
    GenerationBudget(batch_size=4, max_length=2048, dtype=None, prompt_length=1024, max_new_tokens=None)
    """
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise InvalidOption(f"--generation takes BATCH,MAX_LENGTH or BATCH,MAX_LENGTH,PROMPT as integers, got "
                            f"{text!r}; e.g. --generation 4,2048.")
    batch, length, *prompt = map(int, parts)
    return GenerationBudget(batch, length, prompt_length=prompt[0] if prompt else None)


def parse_inputs(text: str):
    """``"input_ids=1x512,pixel_values=1x3x512x512"`` -> ``{"input_ids": (1, 512), ...}``; ``"default"`` as is.

    Raises
    ------
    InvalidOption
        An entry that is not ``NAME=DIMxDIM...`` of positive integers, or a name given twice.

    Examples
    --------
    >>> parse_inputs("input_ids=1x512,pixel_values=1x3x64x64")
    {'input_ids': (1, 512), 'pixel_values': (1, 3, 64, 64)}
    >>> parse_inputs("input_ids=1x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    allocator.errors.InvalidOption: --inputs entry 'input_ids=1x' is not NAME=DIMxDIM... of positive integers; ...
    """
    if text.strip() == "default":
        return "default"
    out: dict = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, shape = (s.strip() for s in part.partition("="))
        dims = shape.lower().split("x")
        if not sep or not name.isidentifier() or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise InvalidOption(f"--inputs entry {part!r} is not NAME=DIMxDIM... of positive integers; write e.g. "
                                "input_ids=1x512 or pixel_values=1x3x512x512.")
        if name in out:
            raise InvalidOption(f"--inputs names {name!r} twice; give each input once.")
        out[name] = tuple(int(d) for d in dims)
    return out


def parse_max_memory(text: str) -> dict:
    """``"0=20GiB,1=20GiB,cpu=64GiB"`` -> ``{0: "20GiB", 1: "20GiB", "cpu": "64GiB"}``, checked.

    A size of digits alone is bytes (``cpu=64`` is ``{"cpu": 64}``, with accelerate's reading and its warning).

    Raises
    ------
    InvalidBudget
        An entry that is not ``DEVICE=SIZE``, an unknown device or a malformed size.

    Examples
    --------
    >>> parse_max_memory("0=20GiB,cpu=64GiB")
    {0: '20GiB', 'cpu': '64GiB'}
    >>> parse_max_memory("gpu=1GiB")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    allocator.errors.InvalidBudget: unknown device 'gpu': use an accelerator index ...
    """
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise InvalidBudget(f"--max-memory entry {part!r} is not DEVICE=SIZE; write e.g. 0=20GiB,cpu=64GiB.")
        device = int(key) if key.isdigit() else key
        if device in out:
            raise InvalidBudget(f"--max-memory gives device {key!r} twice ({device}={out[device]} and {part}); give "
                                "each device once.")
        out[device] = int(value) if value.isdigit() else value  # bytes, as in a dict
    for key, value in out.items():
        small_bare_number(key, value)
    if not out:
        raise InvalidBudget("--max-memory is empty; write e.g. 0=20GiB,cpu=64GiB.")
    parse_budgets(out)  # unknown devices, malformed sizes, a device named twice: before building any model
    return out


def warn_absent_accelerators(max_memory: dict | None) -> None:
    """One warning (the command line prints it as one ``allocator: warning:`` line on stderr) naming the accelerators
    of ``--max-memory`` that this machine does not have: ``plan`` and ``fit`` plan onto them all the same, for a
    machine that has them, and loading such a plan here would fail.

    >>> warn_absent_accelerators({"cpu": "1GiB"})   # no accelerator named: nothing to say
    """
    missing = absent_accelerators(parse_budgets(max_memory).accelerators) if max_memory else []
    if missing:
        names = ", ".join(map(str, missing))
        them = "them" if len(missing) > 1 else "it"
        warn_caller(f"--max-memory names accelerator{'s' if len(missing) > 1 else ''} {names}, which this machine does "
                    f"not have: the plan is for a machine that has {them}, and loading it here would fail; leave "
                    f"{them} out of --max-memory to plan for this machine.")


def load_profile(path: str):
    """The :class:`~allocator.Profile` stored in ``path`` by ``allocator profile --out`` (:meth:`Profile.load`)."""
    return Profile.load(path)


def load_expert_profile(path: str, model) -> ExpertProfile:
    """The :class:`~allocator.ExpertProfile` in ``path`` (``--expert-profile``), checked against ``model``: it must
    name the model's mixture-of-experts layers with their numbers of experts.

    Raises
    ------
    InvalidOption
        A file that cannot be read or is not an expert profile, a model without mixture-of-experts layers, or a
        profile of another model (no layer in common, or another number of experts).
    """
    hint = "record one for this model with allocator.profile_experts(model, batches).save(FILE)"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise InvalidOption(f"--expert-profile {path}: cannot read it ({one_line(err)}); {hint}.") from None
    try:
        profile = ExpertProfile.from_json(text)
    except InvalidOption as err:   # JSON, of another kind: the reader's own words say which format it expects
        raise InvalidOption(f"--expert-profile {path}: {err}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:   # not JSON, or its counts malformed
        raise InvalidOption(f"--expert-profile {path} is not an expert profile ({one_line(err)}); {hint}.") from None
    layers = {layer.experts: layer.num_experts for layer in family_of(model).experts(model)}
    if not layers:
        raise InvalidOption(f"--expert-profile {path}: {type(model).__name__} has no mixture-of-experts layer, so "
                            "there are no experts to place; drop --expert-profile.")
    common = [name for name in profile.counts if name in layers]
    if not common:
        raise InvalidOption(f"--expert-profile {path} names none of {type(model).__name__}'s mixture-of-experts "
                            f"layers (it names {', '.join(sorted(profile.counts)[:2]) or 'none'}, the model has "
                            f"{next(iter(layers))}, ...): it was recorded on another model; {hint}.")
    for name in common:
        if len(profile.counts[name]) != layers[name]:
            raise InvalidOption(f"--expert-profile {path} counts {len(profile.counts[name])} experts for {name}, "
                                f"which has {layers[name]}: it was recorded on another model; {hint}.")
    return profile


def check_writable(path: str | None, flag: str) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InvalidOption(f"{flag} {path}: folder {folder} does not exist.")


def check_expert_cache(slots: int, model) -> int:
    """``--expert-cache N``: ``N`` where ``model`` has mixture-of-experts layers to cache experts of.

    Raises
    ------
    InvalidOption
        A model without mixture-of-experts layers.
    """
    if not family_of(model).experts(model):
        raise InvalidOption(f"--expert-cache {slots}: {type(model).__name__} has no mixture-of-experts layer, so "
                            "there are no routed experts to cache; drop --expert-cache.")
    return slots
