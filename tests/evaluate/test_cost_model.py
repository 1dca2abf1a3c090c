"""The cost model measured from the model itself (issue #21): ``Profile.measure``'s fields and spreads, the per-op and
boundary terms where FLOPs were counted (in ``estimate`` and in ``ilp``'s objective alike), Segformer at 512² with a
GPU at 90 %, and the command line's ``--inputs`` and ``profile`` output."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch.nn as nn

import allocator
from allocator import cli
from allocator.model import zoo
from allocator.evaluate.cost import boundaries, change_seconds, estimate
from allocator.profile import Profile
from allocator.errors import InvalidOption
from allocator.model.flops import count_flops, node_values
from allocator.problem import build_problem
from allocator.evaluate.units import boundary_bytes

MEASURED = ("cpu_memory", "cpu_flops", "cpu_op_latency", "cpu_pointwise", "cpu_strided", "disk_read", "disk_read_warm",
            "offload_tensor_latency", "disk_tensor_latency")


# -- Profile ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return Profile.measure(size=2**16, repeats=2, folder=tmp_path_factory.mktemp("disk"))


def test_measure_reports_every_measured_field_with_its_spread(measured):
    default = Profile()
    for name in MEASURED:
        assert name in measured.spread and measured.spread[name] >= 0, name
        assert getattr(measured, name) > 0 and getattr(measured, name) != getattr(default, name), name
    # without CUDA the accelerator keeps its documented defaults, and says so by having no spread
    for name in ("accelerator_flops", "accelerator_op_latency", "accelerator_tensor_latency", "host_to_device"):
        assert (name in measured.spread) == (getattr(measured, name) != getattr(default, name)), name
    assert 0 < measured.cpu_op_latency < 1e-3 and measured.cpu_flops > 1e8
    assert measured.disk_read_warm > 1e6 and measured.disk_read > 1e6


def test_spread_is_read_only_and_outside_equality(measured):
    same = dataclasses.replace(measured, spread={})
    assert same == measured and hash(same) == hash(measured)
    with pytest.raises(TypeError):
        measured.spread["cpu_flops"] = 0.0
    with pytest.raises(InvalidOption, match="spread"):
        Profile(spread={"no_such_field": 0.1})
    with pytest.raises(InvalidOption, match="spread"):
        Profile(spread={"cpu_flops": -1})


def test_profile_round_trips_and_old_files_without_new_fields_still_load(measured, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(measured.to_dict()))
    loaded = Profile.load(path)
    assert loaded == measured and dict(loaded.spread) == dict(measured.spread)
    old = {k: v for k, v in Profile().to_dict().items()
           if k not in ("disk_read_warm", "cpu_op_latency", "accelerator_op_latency", "accelerator_tensor_latency",
                        "cpu_pointwise", "cpu_strided", "spread")}
    path.write_text(json.dumps(old | {"cpu_flops": 5e10}))
    assert Profile.load(path) == Profile(cpu_flops=5e10)


def test_measure_checks_its_arguments(tmp_path):
    with pytest.raises(InvalidOption, match="not a folder"):
        Profile.measure(size=2**12, repeats=1, folder=tmp_path / "missing")
    with pytest.raises(InvalidOption, match="repeats >= 1"):
        Profile.measure(repeats=0)


# -- the op term -----------------------------------------------------------------------------------------------------


def _mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())


def test_each_counted_op_costs_its_latency_where_it_executes():
    base = Profile(cpu_op_latency=0, accelerator_op_latency=0)
    slow = dataclasses.replace(base, cpu_op_latency=1e-3, accelerator_op_latency=1e-4)
    inputs = {"input": (8, 64)}
    count = count_flops(_mlp(), inputs)
    ops = sum(count.ops.values())
    assert ops >= 4   # two products and two activations, at least
    for device_map, latency in (({"": "cpu"}, 1e-3), ({"": 0}, 1e-4)):
        seconds = {}
        for profile in (base, slow):
            problem = build_problem(_mlp(), {0: 10**6, "cpu": 10**6}, inputs=inputs, profile=profile)
            seconds[profile.cpu_op_latency] = estimate(problem, device_map).seconds
        assert seconds[1e-3] - seconds[0] == pytest.approx(ops * latency, rel=1e-6)
    # not counted: no op term, whatever the profile says
    plain = [estimate(build_problem(_mlp(), {"cpu": 10**6}, profile=p), {"": "cpu"}).seconds for p in (base, slow)]
    assert plain[0] == plain[1]


# -- the boundary term -----------------------------------------------------------------------------------------------


def _wide_narrow():
    """Four layers whose outputs are 8 x 1024, 8 x 4, 8 x 1024 and 8 x 4 floats: a cut after an odd layer moves
    little, after an even one a lot."""
    return nn.Sequential(nn.Linear(4, 1024), nn.Linear(1024, 4), nn.Linear(4, 1024), nn.Linear(1024, 4))


def test_boundary_bytes_are_the_outputs_of_the_module_before_each_cut():
    model = _wide_narrow()
    problem = build_problem(model, {"cpu": 10**8}, inputs={"input": (8, 4)})
    crossing = boundary_bytes(problem.graph, node_values(problem.flops.output_bytes, problem.graph))
    first = {name: problem.graph.tensor_index[f"{name}.weight"] for name in ("1", "2", "3")}
    assert crossing[first["1"]] == 8 * 1024 * 4 and crossing[first["2"]] == 8 * 4 * 4
    assert crossing[first["3"]] == 8 * 1024 * 4
    assert crossing[len(problem.graph.tensors)] == 8 * 4 * 4   # the last layer's, not the root's output
    assert boundaries(build_problem(model, {"cpu": 10**8})) is None


def test_a_device_change_moves_the_counted_activation_not_the_fixed_one():
    profile = Profile(device_to_device=1e6, activation_bytes=10**6)   # 1 MB/s: the transfer dominates
    budget = {0: 10**8, 1: 10**8, "cpu": 10**8}
    counted = build_problem(_wide_narrow(), budget, inputs={"input": (8, 4)}, profile=profile)
    plain = build_problem(_wide_narrow(), budget, profile=profile)
    narrow = {"0": 0, "1": 0, "2": 1, "3": 1}    # cut after 8 x 4 floats
    wide = {"0": 0, "1": 0, "2": 0, "3": 1}      # cut after 8 x 1024 floats
    for problem in (counted, plain):
        cut = {name: estimate(problem, m) for name, m in (("narrow", narrow), ("wide", wide))}
        assert cut["narrow"].device_changes == cut["wide"].device_changes == 1
    same = estimate(plain, wide).seconds - estimate(plain, narrow).seconds
    assert abs(same) < 1e-6    # the fixed activation: either cut costs the same
    gap = estimate(counted, wide).seconds - estimate(counted, narrow).seconds
    assert gap == pytest.approx(change_seconds(profile, 8 * 1024 * 4) - change_seconds(profile, 8 * 4 * 4), rel=1e-3)
    assert gap > 0.02


def test_ilp_cuts_where_the_activation_is_small():
    pytest.importorskip("ortools")
    # RAM slow to read and to copy from: the CPU neither runs nor streams; what is left is where to cut
    profile = Profile(device_to_device=1e6, activation_bytes=10**6, cpu_memory=1e3, host_to_device=1e3)
    layer = 4 * 1024 * 4 + 1024 * 4   # weight and bias of a 4 -> 1024 layer, in float32 (the 1024 -> 4 is close)
    budget = {0: int(2.5 * layer), 1: int(2.5 * layer), "cpu": 10**8}
    problem = build_problem(_wide_narrow(), budget, inputs={"input": (8, 4)}, profile=profile, objective="latency")
    from allocator.strategies import ilp

    wide = {"0": 0, "1": 0, "2": 0, "3": 1}   # the warm start: a valid plan that cuts after 8 x 1024 floats
    placed = ilp.place(problem, hint=wide)
    m = placed.device_map
    assert set(m) == {"0", "1", "2", "3"} and m["0"] == m["1"] != m["2"] == m["3"]   # the cut after 8 x 4 floats
    assert {m["0"], m["2"]} == {0, 1}
    objective = placed.decisions[0].facts["seconds"]   # the solver's decision records its objective
    assert objective == pytest.approx(estimate(problem, m).seconds, abs=1e-9)   # its objective is the estimate


# -- Segformer at 512² with a GPU at 90 % ----------------------------------------------------------------------------


def test_segformer_at_512_with_a_gpu_at_90_percent_runs_on_the_gpu():
    model = zoo.build("segformer-b0")
    total = build_problem(model, {"cpu": 0}).graph.total
    found = allocator.plan(model, {0: int(0.9 * total), "cpu": 10 * total}, objective="latency",
                           inputs={"pixel_values": (1, 3, 512, 512)})
    assert found.main_device == 0
    assert found.inputs == {"pixel_values": (1, 3, 512, 512)}
    assert "compute term counted at pixel_values=1x3x512x512" in found.explain()


def test_inputs_default_to_the_configs_where_the_estimate_alone_decides(caplog):
    model = zoo.build("vit-base")
    budget = {0: "100MB", "cpu": "2GB"}
    assert allocator.PlanOptions().inputs == "auto"
    latency = allocator.plan(model, budget, objective="latency")
    assert latency.inputs == {"pixel_values": (1, 3, 224, 224)}
    assert "(the config's defaults)" in latency.compute_term()
    assert allocator.plan(model, budget).inputs is None                     # the contract: nothing counted
    assert allocator.plan(model, budget, objective="latency", inputs=None).inputs is None
    with caplog.at_level("WARNING", logger="allocator"):
        plain = allocator.plan(_mlp(), {0: 10**5, "cpu": 10**6}, objective="latency")   # no config, no defaults
    assert plain.inputs is None and not caplog.records


def test_a_count_stops_past_its_op_limit_and_says_so():
    count = count_flops(_mlp(), {"input": (8, 64)}, max_ops=3)
    assert not count.complete and count.reason() == ("the forward dispatched more than 3 ops (counting stops there; "
                                                      "count_flops(max_ops=...) raises the limit)")
    assert count_flops(_mlp(), {"input": (8, 64)}).complete


def test_explain_says_when_the_compute_term_is_estimated():
    found = allocator.plan(_mlp(), {"cpu": 10**6})
    assert found.inputs is None and "compute term estimated: 2 x params x 512 tokens" in found.explain()


# -- command line ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["input_ids", "input_ids=1x", "input_ids=0x512", "input_ids=1x512,input_ids=1x4",
                                  "=1x512", "input_ids=1xa"])
def test_cli_inputs_that_do_not_parse_exit_2_with_one_line(capsys, text):
    code = cli.main(["plan", "segformer-b0", "--max-memory", "cpu=1GiB", "--inputs", text])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "--inputs" in err, err


def test_cli_plan_with_inputs_says_what_it_counted(capsys):
    code = cli.main(["plan", "segformer-b0", "--max-memory", "cpu=1GiB", "--inputs", "pixel_values=1x3x64x64"])
    out, _ = capsys.readouterr()
    assert code == 0 and "compute term counted at pixel_values=1x3x64x64 (the inputs given)" in out
    assert cli.parse_inputs("input_ids=1x512,pixel_values=1x3x8x8") == {"input_ids": (1, 512),
                                                                         "pixel_values": (1, 3, 8, 8)}
    assert cli.parse_inputs("default") == "default"


def test_cli_profile_prints_each_field_in_its_unit_with_the_spread(capsys, tmp_path):
    code = cli.main(["profile", "--folder", str(tmp_path), "--out", str(tmp_path / "p.json")])
    out, _ = capsys.readouterr()
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip() and "profile" not in line}
    assert rows["cpu_flops"][2] == "GFLOP/s" and rows["accelerator_flops"][2] == "GFLOP/s"
    assert rows["disk_read"][2] == rows["disk_read_warm"][2] == rows["cpu_memory"][2] == "GB/s"
    for name in ("cpu_op_latency", "accelerator_op_latency", "accelerator_tensor_latency", "offload_tensor_latency"):
        assert rows[name][2] in ("µs", "ms"), rows[name]
    assert "spread" in " ".join(rows["cpu_flops"]) and rows["accelerator_op_latency"][-1] == "default"
    assert list(tmp_path.iterdir()) == [tmp_path / "p.json"]   # the disk test file is gone
    code = cli.main(["profile", "--folder", str(tmp_path / "missing")])
    _, err = capsys.readouterr()
    assert code == 2 and "--folder" in err and err.count("\n") == 1


# -- the memory traffic term -----------------------------------------------------------------------------------------


def test_ops_without_a_flop_formula_cost_the_bytes_they_write():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.GELU())
    count = count_flops(model, {"input": (1000, 64)})
    out = 1000 * 64 * 4
    assert count.written["1"] == out and count.pointwise["1"] == 0     # a maximum: memory traffic
    assert count.pointwise["2"] == out and count.written["2"] == 0     # a function per element
    assert count.written["0"] == count.pointwise["0"] == 0             # a product (FLOPs) and a view of the weight
    profile = Profile(cpu_memory=1e6, cpu_pointwise=1e5, cpu_flops=1e15, cpu_op_latency=0)
    counted = build_problem(model, {"cpu": 10**6}, inputs={"input": (1000, 64)}, profile=profile)
    weights = (64 * 64 + 64) * 4
    assert estimate(counted, {"": "cpu"}).seconds == pytest.approx((weights + out) / 1e6 + out / 1e5, rel=1e-6)
    plain = build_problem(model, {"cpu": 10**6}, profile=profile)
    assert estimate(plain, {"": "cpu"}).seconds == pytest.approx(weights / 1e6, rel=1e-6)
    # on an accelerator both are memory traffic at its memory rate
    fast = dataclasses.replace(profile, accelerator_memory=1e6, accelerator_flops=1e15, accelerator_op_latency=0)
    on_gpu = build_problem(model, {0: 10**6}, inputs={"input": (1000, 64)}, profile=fast)
    assert estimate(on_gpu, {"": 0}).seconds == pytest.approx((weights + 2 * out) / 1e6, rel=1e-6)


class _Resize(nn.Module):
    """A token map ``(1, H*W, C)`` resized as an image: through a ``permute``/``reshape`` view (SegFormer's decode
    head) or through a contiguous copy of it."""

    def __init__(self, contiguous: bool):
        super().__init__()
        self.contiguous = contiguous

    def forward(self, tokens):
        image = tokens.permute(0, 2, 1).reshape(1, -1, 16, 16)
        image = image.contiguous() if self.contiguous else image
        return nn.functional.interpolate(image, size=(32, 32), mode="bilinear", align_corners=False)


@pytest.mark.parametrize("contiguous", [False, True])
def test_an_interpolation_across_memory_layouts_is_charged_at_the_strided_rate(contiguous):
    model = nn.Sequential(nn.Linear(8, 8), _Resize(contiguous))
    inputs = {"input": (1, 256, 8)}
    count = count_flops(model, inputs)
    out = 8 * 32 * 32 * 4
    assert (count.strided["1"], count.pointwise["1"]) == ((0, out) if contiguous else (out, 0))
    profile = Profile(cpu_memory=1e9, cpu_pointwise=1e6, cpu_strided=1e5, cpu_flops=1e15, cpu_op_latency=0)
    problem = build_problem(model, {"cpu": 10**6}, inputs=inputs, profile=profile)
    moved = 8 * 16 * 16 * 4 if contiguous else 0   # the copy .contiguous() writes: memory traffic
    weights = (8 * 8 + 8) * 4
    expected = (weights + moved) / 1e9 + (out / 1e6 if contiguous else out / 1e5)
    assert estimate(problem, {"": "cpu"}).seconds == pytest.approx(expected, rel=1e-6)


# -- a decoding step -------------------------------------------------------------------------------------------------


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_a_generation_budget_costs_a_decoding_step_next_to_the_prefill():
    model = _tiny_llama()
    inputs = {"input_ids": (1, 256)}
    costs = {}
    for length in (512, 4096):
        found = allocator.plan(model, {"cpu": 10**9}, inputs=inputs,
                               generation=allocator.GenerationBudget(1, length, prompt_length=256))
        assert set(found.costs) == {"prefill", "decode"} and found.cost == found.costs["prefill"]
        steps = found.problem.steps
        assert steps["decode"].inputs == {"input_ids": (1, 1)} and steps["prefill"].inputs == {"input_ids": (1, 256)}
        assert steps["decode"].total < steps["prefill"].total / 100
        costs[length] = {k: v.seconds for k, v in found.costs.items()}
    # the prefill does not read the cache; the step reads all of it: a longer context costs it more
    assert costs[4096]["prefill"] == pytest.approx(costs[512]["prefill"])
    cache = {n: allocator.build_problem(model, {"cpu": 10**9},
                                        generation=allocator.GenerationBudget(1, n, prompt_length=256))
             .generation.cache_bytes for n in (512, 4096)}
    assert costs[4096]["decode"] - costs[512]["decode"] == pytest.approx(
        (cache[4096] - cache[512]) / Profile().cpu_memory, rel=1e-6)
    # without a generation budget only the prefill is counted
    assert set(allocator.plan(model, {"cpu": 10**9}, inputs=inputs).costs) == {"prefill"}


def test_optimize_decode_makes_the_objectives_price_the_step():
    model = _tiny_llama()
    generation = allocator.GenerationBudget(1, 1024, prompt_length=256)
    found = allocator.plan(model, {"cpu": 10**9}, inputs={"input_ids": (1, 256)}, generation=generation,
                           optimize="decode")
    assert found.cost == found.costs["decode"] and found.costs["prefill"].seconds > found.cost.seconds
    assert "one decoding step" in found.compute_term() and "objectives price the decode" in found.explain()
    with pytest.raises(InvalidOption, match="needs inputs"):
        allocator.PlanOptions(optimize="decode", generation=generation)
    with pytest.raises(InvalidOption, match="one of"):
        allocator.PlanOptions(optimize="fastest")
    with pytest.raises(InvalidOption, match="token inputs"):
        allocator.plan(model, {"cpu": 10**9}, inputs={"inputs_embeds": (1, 8, 64)}, generation=generation,
                       optimize="decode")


def test_cli_optimize_decode_prints_both_steps(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    folder.mkdir()
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=500,
                             architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    code = cli.main(["plan", str(folder), "--max-memory", "cpu=1GiB", "--inputs", "input_ids=1x64",
                     "--generation", "1,512,64", "--optimize", "decode"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "per step: prefill" in out and "the plan minimises the decode" in out
    code = cli.main(["plan", str(folder), "--max-memory", "cpu=1GiB", "--optimize", "decode"])
    _, err = capsys.readouterr()
    assert code == 2 and "needs inputs" in err and err.count("\n") == 1


# -- the offload runtime ---------------------------------------------------------------------------------------------


def test_our_offload_runtime_is_priced_without_a_file_open_or_a_cache_emptied_per_tensor():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))   # two tensors per Linear
    profile = Profile()
    on = {}
    for runtime in ("accelerate", "allocator"):
        problem = build_problem(model, {0: 10**6, "cpu": 10**6}, profile=profile, runtime=runtime, prefetch=0)
        on[runtime] = (estimate(problem, {"0": "cpu", "1": "disk"}).seconds,
                       estimate(problem, {"0": 0, "1": "cpu"}).seconds)
    cpu_main, gpu_main = (a - b for a, b in zip(on["accelerate"], on["allocator"]))
    assert cpu_main == pytest.approx(2 * profile.disk_tensor_latency, rel=1e-9)
    hooks_only = profile.accelerator_tensor_latency - profile.offload_tensor_latency   # accelerate's empty_cache
    # the bytes: accelerate's hooks copy pageable memory; ours stage the mapped weights into pinned memory first
    streamed = sum(p.numel() * p.element_size() for p in model[1].parameters())
    staging = streamed / profile.host_to_device - streamed * (1 / profile.cpu_memory
                                                              + 1 / profile.pinned_host_to_device)
    assert gpu_main == pytest.approx(2 * hooks_only + staging, rel=1e-9)
