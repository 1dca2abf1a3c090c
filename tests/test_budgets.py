import math
import warnings

import pytest
import torch

import allocator
from allocator.budgets import normalize_device, parse_budgets, parse_size
from allocator.errors import InvalidBudget


@pytest.mark.parametrize("text,expected", [
    ("10GiB", 10 * 2**30), ("500MB", 500 * 10**6), ("1.5GiB", int(1.5 * 2**30)), ("12KiB", 12 * 1024),
    (1234, 1234), (0, 0), ("2 GB", 2 * 10**9), ("1e3MB", 10**9), ("10gib", 10 * 2**30),
])
def test_parse_size_accepts_what_accelerate_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", -5, "ten", "10XB", "", float("nan"), float("inf"), True, None, [1]])
def test_parse_size_rejects_with_a_fix(bad):
    with pytest.raises(InvalidBudget, match=r"size|bytes|negative|finite|boolean|must"):
        parse_size(bad)


@pytest.mark.parametrize("text,fix", [
    ("1e9", "give the int 1000000000 for bytes"), ("64", "give the int 64 for bytes, or a string with a unit such as "
                                                          "'64GiB'"),
    ("0", "give the int 0 for bytes"), ("2.5", "write it with a unit, such as '2.5GiB' or '2.5MB'"),
])
def test_a_string_without_a_unit_is_rejected_as_accelerate_rejects_it(text, fix):
    from accelerate.utils import convert_file_size_to_int

    with pytest.raises(ValueError):
        convert_file_size_to_int(text)
    with pytest.raises(InvalidBudget, match="has no unit, and accelerate rejects") as raised:
        parse_size(text)
    assert fix in str(raised.value)
    assert "give the int 2 " not in str(raised.value)   # a fraction is no int of bytes


@pytest.mark.parametrize("bad", [-5, "-5", "-5GiB", -0.5, "-2.5", "-1e9"])
def test_a_negative_size_is_refused_with_a_hint_that_is_not_itself_negative(bad):
    with pytest.raises(InvalidBudget) as raised:
        parse_size(bad, what="max_memory['cpu']")
    message = str(raised.value)
    assert message.startswith(f"max_memory['cpu'] is negative ({bad!r}); budgets are non-negative: give an int of 0 "
                              "or more bytes, or a string with a unit such as '10GiB'")
    assert "int -" not in message and "'-" not in message.split(";")[1]


def said(size, what="max_memory['cpu']"):
    """``parse_size(size)`` and the messages of the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = parse_size(size, what=what)
    return value, [str(w.message) for w in caught]


@pytest.mark.parametrize("text,expected,read", [
    ("3Gib", 3 * 2**30, "3 GiB = 3221225472 bytes (3.00 GiB), as accelerate reads it"),
    ("3gib", 3 * 2**30, "3 GiB = 3221225472 bytes (3.00 GiB), as accelerate reads it"),
    ("3GIB", 3 * 2**30, "3 GiB = 3221225472 bytes (3.00 GiB), as accelerate reads it"),
    ("1.5mib", int(1.5 * 2**20), "1.5 MiB = 1572864 bytes (1.50 MiB), as accelerate reads it"),
    ("3gB", 3 * 10**9, "3 GB = 3000000000 bytes (2.79 GiB), as accelerate reads it"),
    ("512mB", 512 * 10**6, "512 MB = 512000000 bytes (488.28 MiB), as accelerate reads it"),
    ("2tib", 2 * 2**40, "2 TiB = 2199023255552 bytes (2048.00 GiB), whatever the case of the unit (accelerate does "
                        "not read this unit)"),
    ("100b", 100, "100 B = 100 bytes (100 B), whatever the case"),
])
def test_a_unit_in_an_unusual_case_is_read_as_accelerate_reads_it_and_said(text, expected, read):
    from accelerate.utils import convert_file_size_to_int

    value, messages = said(text)
    if text.upper().endswith(("KB", "MB", "GB", "IB")) and not text.upper().endswith("TIB"):
        assert convert_file_size_to_int(text) == expected   # accelerate 1.16 reads it so
    assert value == expected
    assert len(messages) == 1 and messages[0].startswith(f"max_memory['cpu'] {text!r} is read as {read}")
    usual = text.rstrip("bBiIgGmMtTkK") + read.split(" = ")[0].split(" ")[1]
    assert messages[0].endswith(f"; write '{usual}'.")


@pytest.mark.parametrize("text", ["3GiB", "3GB", "3kB", "3KB", "3MiB", "3KiB", "3TB", "3TiB", "300B", "1.5GB"])
def test_usual_spellings_give_no_warning(text):
    assert said(text)[1] == []


def test_each_distinct_budget_string_warns_once_per_process():
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            allocator.plan(model, {"cpu": "1gib"})
            parse_budgets({"cpu": "1gib", "disk": "10Gb"})
        parse_budgets({"cpu": "2gib"})   # another string: its own warning
    messages = [str(w.message) for w in caught if "is read as" in str(w.message)]
    assert sorted(messages) == sorted(set(messages)) and len(messages) == 3
    assert sum("'1gib'" in m for m in messages) == 1 and sum("'10Gb'" in m for m in messages) == 1


@pytest.mark.parametrize("size,expected", [(64.5, 64), (40400.7, 40400), (1e-3, 0)])
def test_a_fractional_float_is_read_as_accelerate_compares_it_and_said(size, expected):
    value, messages = said(size)
    assert value == expected
    assert len(messages) == 1
    assert messages[0].startswith(f"max_memory['cpu'] = {size!r} is not a whole number of bytes; it is read as "
                                  f"{expected} bytes, as accelerate compares it with whole byte counts; give the int "
                                  f"{expected}, or a string with a unit such as '{size:g}GiB'")


def test_accelerate_accepts_a_float_budget_and_holds_what_its_floor_holds():
    """Why a fractional float is warned about rather than refused: accelerate's get_max_memory passes it through and
    infer_auto_device_map compares it with whole byte counts, so the float and its floor place the same."""
    from accelerate.utils import get_max_memory, infer_auto_device_map

    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))   # 40,400 B each
    assert get_max_memory({"cpu": 90000.5}) == {"cpu": 90000.5}
    for size in (90000.5, 40400.5, 40399.5):
        assert infer_auto_device_map(model, max_memory={"cpu": size}) == \
            infer_auto_device_map(model, max_memory={"cpu": int(size)})


def test_a_whole_float_gives_no_warning():
    assert said(8e9) == (8 * 10**9, [])


#: Where allocator reads more than accelerate's convert_file_size_to_int (documented in docs/api.md).
EXTENSIONS = ("10TB", "1TiB", "100B", "0B")


@pytest.mark.parametrize("text", ["10GiB", "10gib", "3Gib", "3GIB", "3gB", "1.5GB", "10gb", "10Gb", "3mb", "5KB",
                                  "7kb", "1e3MB", "2 GB", "1e9", "64", "ten", "10XB", "", "-1GB", "-5", "2.5",
                                  *EXTENSIONS])
def test_strings_are_read_as_accelerate_reads_them(text):
    from accelerate.utils import convert_file_size_to_int

    try:
        theirs = convert_file_size_to_int(text)
    except ValueError:
        theirs = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = parse_size(text)
    except InvalidBudget:
        ours = None
    if text in EXTENSIONS:
        assert theirs is None and ours is not None
    else:
        assert ours == theirs


@pytest.mark.parametrize("text,read,fix", [
    ("10gb", "10 Gbit = 1250000000 bytes (1.25 GB)", "'10GB' for 10 GB"),
    ("4Gb", "4 Gbit = 500000000 bytes (500 MB)", "'4GB' for 4 GB"),
    ("512mb", "512 Mbit = 64000000 bytes (64 MB)", "'512MB' for 512 MB"),
])
def test_a_lower_case_b_is_bits_with_a_warning(text, read, fix):
    with pytest.warns(UserWarning) as caught:
        value = parse_size(text, what="max_memory['cpu']")
    assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line, not allocator's
    message = str(caught[0].message)
    assert message.startswith(f"max_memory['cpu'] {text!r} is read as {read}") and fix in message
    assert value == int(read.split("= ")[1].split()[0])


def test_a_small_bare_number_warns_on_the_command_line_only():
    from allocator.budgets import small_bare_number

    with pytest.warns(UserWarning, match=r"max_memory\['cpu'\] = 64 is read as 64 bytes.*'64GiB'") as caught:
        small_bare_number("cpu", 64)
    assert caught[0].filename == __file__
    # an int is bytes in the API, as in accelerate, whose own tests plan with a few hundred bytes: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_budgets({"cpu": 64}).limit("cpu") == 64
        allocator.plan(torch.nn.Linear(2, 2), {0: 8, "cpu": "1MiB"})


@pytest.mark.parametrize("budget", [{"cpu": 0}, {"cpu": 2**20}, {"cpu": "64KiB"}, {"cpu": "10GB"}, {0: "1GiB"}])
def test_no_warning_for_what_is_clearly_meant(budget):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_budgets(budget)


@pytest.mark.parametrize("key,expected", [
    (0, 0), ("cuda:1", 1), ("xpu:0", 0), ("npu:2", 2), ("mps", "mps"), ("CPU", "cpu"), ("disk", "disk"), ("3", 3),
])
def test_device_keys(key, expected):
    assert normalize_device(key) == expected


def test_torch_device_keys():
    import torch

    assert normalize_device(torch.device("cuda", 1)) == 1
    assert normalize_device(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", -1, 1.5, False])
def test_unknown_devices_are_typed_errors(bad):
    with pytest.raises(InvalidBudget, match="device"):
        normalize_device(bad)


def test_order_and_disk_and_no_mutation():
    given = {"cpu": "1GiB", "cuda:1": "2GB", 0: 100, "disk": "1TB"}
    snapshot = dict(given)
    b = parse_budgets(given)
    assert b.order == (0, 1, "cpu", "disk")
    assert b.limit(0) == 100 and b.limit("disk") == 10**12
    assert given == snapshot


def test_duplicate_device_and_wrong_type():
    with pytest.raises(InvalidBudget, match="twice"):
        parse_budgets({0: 1, "cuda:0": 2})
    with pytest.raises(InvalidBudget, match="dict"):
        parse_budgets([("cpu", 1)])


def test_default_budget_is_this_machine():
    b = parse_budgets(None)
    assert "cpu" in b.order and b.limit("cpu") > 0


def test_errors_are_value_errors():
    for cls in (allocator.InvalidBudget, allocator.InfeasiblePlacement, allocator.InvalidOption,
                allocator.InvalidModel, allocator.InvalidDeviceMap, allocator.UnsupportedByAccelerate):
        assert issubclass(cls, ValueError)
    assert math.isfinite(parse_size(0))
