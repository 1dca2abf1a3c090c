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


@pytest.mark.parametrize("text,fix", [("1e9", "1000000000"), ("64", "64"), ("0", "0"), ("2.5", "2")])
def test_a_string_without_a_unit_is_rejected_as_accelerate_rejects_it(text, fix):
    from accelerate.utils import convert_file_size_to_int

    with pytest.raises(ValueError):
        convert_file_size_to_int(text)
    with pytest.raises(InvalidBudget, match=f"has no unit, and accelerate rejects.*give the int {fix} for bytes"):
        parse_size(text)


#: Where allocator reads more than accelerate's convert_file_size_to_int (documented in docs/api.md).
EXTENSIONS = ("10TB", "1TiB", "100B", "0B")


@pytest.mark.parametrize("text", ["10GiB", "10gib", "1.5GB", "10gb", "10Gb", "3mb", "5KB", "7kb", "1e3MB", "2 GB",
                                  "1e9", "64", "ten", "10XB", "", "-1GB", *EXTENSIONS])
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
