"""FLOPs counted on the meta device (allocator.model.flops), charged to units, and the cost model that reads them."""

import json
import logging

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import allocator
from allocator import InvalidOption, PlanOptions, Profile, build_problem, estimate
from allocator.evaluate.cost import tensor_seconds
from allocator.model.flops import count_flops, default_inputs, node_flops
from allocator.model import build_graph
from allocator.evaluate.units import tensor_flops, unit_flops, units

transformers = pytest.importorskip("transformers")

LAYERS, HEADS, HEAD_DIM, TOKENS = 2, 4, 16, 64


def tiny_llama(attn="eager"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=TOKENS, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=32, patch_size=8, attn_implementation="eager")
    return transformers.ViTModel(config).eval()


def tiny_mixtral(dtype=torch.float32):
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        num_local_experts=4, max_position_embeddings=TOKENS)
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config).to(dtype)


def real_forward(model, shapes):
    """FlopCounterMode over a forward with real weights and real inputs on the CPU: (total, inclusive per module
    path as the counter names them, e.g. 'LlamaForCausalLM.model.layers.0')."""
    torch.manual_seed(1)
    inputs = {k: torch.randint(0, 100, v) if "ids" in k else torch.randn(v) for k, v in shapes.items()}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs)
    return counter.get_total_flops(), {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}


def inclusive(count, path):
    return sum(f for name, f in count.flops.items() if path == "" or name == path or name.startswith(path + "."))


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [m._forward_hooks.copy() for m in model.modules()], \
        [m._forward_pre_hooks.copy() for m in model.modules()]


def assert_unchanged(model, before):
    state, hooks, pre = before
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(state[k], v) and v.device == state[k].device for k, v in after.items())
    assert [m._forward_hooks for m in model.modules()] == hooks
    assert [m._forward_pre_hooks for m in model.modules()] == pre


@pytest.mark.parametrize("make, shapes", [(tiny_llama, {"input_ids": (1, TOKENS)}),
                                          (tiny_vit, {"pixel_values": (1, 3, 32, 32)})], ids=["llama", "vit"])
def test_meta_count_equals_flop_counter_on_real_weights(make, shapes):
    model = make()
    before = snapshot(model)
    count = count_flops(model, shapes)
    assert count.complete and count.copied and count.total > 0
    assert_unchanged(model, before)
    total, per_module = real_forward(model, shapes)
    assert count.total == total
    assert sum(count.flops.values()) == count.total   # exclusive FLOPs sum to the total
    root = type(model).__name__
    compared = 0
    for name, flops in per_module.items():   # every module the real count saw: the same inclusive FLOPs
        if name.startswith(root):
            assert inclusive(count, name[len(root) + 1:]) == flops, name
            compared += 1
    assert compared >= 5


def test_sdpa_on_a_real_cpu_forward_misses_exactly_the_attention_products():
    """On meta, SDPA decomposes into two counted products per layer; on a real CPU forward its fused kernel has no
    formula: the gap is 2 x 2 x heads x tokens^2 x head_dim FLOPs per layer."""
    model = tiny_llama("sdpa")
    count = count_flops(model, {"input_ids": (1, TOKENS)})
    total, _ = real_forward(model, {"input_ids": (1, TOKENS)})
    assert count.total - total == LAYERS * 2 * 2 * HEADS * TOKENS ** 2 * HEAD_DIM
    assert count.total == count_flops(tiny_llama("eager"), {"input_ids": (1, TOKENS)}).total


def test_ops_and_output_bytes_per_module():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    count = count_flops(model, {"input": (3, 8)})
    assert count.flops == {"": 0, "0": 2 * 3 * 8 * 4, "1": 0, "2": 2 * 3 * 4 * 2}
    assert count.output_bytes == {"": 3 * 2 * 4, "0": 3 * 4 * 4, "1": 3 * 4 * 4, "2": 3 * 2 * 4}
    assert count.ops["1"] >= 1 and count.ops[""] == 0
    assert count.inputs == {"input": (3, 8)} and not count.defaults


def test_per_unit_flops_sum_to_the_total_and_parameterless_work_goes_to_its_unit():
    model = tiny_llama()
    count = count_flops(model, {"input_ids": (1, TOKENS)})
    graph = build_graph(model)
    per_node = node_flops(count, graph)
    assert sum(per_node) == count.total
    found = units(graph)
    per_unit = dict(zip(found.name, unit_flops(graph, per_node).tolist()))
    assert sum(per_unit.values()) == count.total
    assert abs(tensor_flops(graph, per_node).sum() - count.total) <= 1e-9 * count.total
    # the decoder layers are units (no-split): their attention scores, run by parameterless code inside, are theirs
    layer = "model.layers.0"
    assert per_unit[layer] == inclusive(count, layer)
    assert count.flops[layer + ".self_attn"] > 0   # the scores: in the attention module itself, not in a Linear


def test_mixture_of_experts_falls_back_visibly(caplog):
    for dtype in (torch.float32, torch.bfloat16):   # grouped products fail on meta in float32, run uncounted in bf16
        model = tiny_mixtral(dtype)
        count = count_flops(model, {"input_ids": (1, 32)})
        assert not count.complete and "_grouped_mm" in count.reason()
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with caplog.at_level(logging.WARNING, logger="allocator.problem"):
        problem = build_problem(model, {"cpu": 10**9}, inputs={"input_ids": (1, 32)})
    assert problem.flops is not None and problem.node_flops is None
    assert "_grouped_mm" in caplog.text and "2 x params x tokens" in caplog.text
    plain = build_problem(model, {"cpu": 10**9})
    assert estimate(problem, {"": "cpu"}) == estimate(plain, {"": "cpu"})


def test_default_inputs_from_the_config():
    assert default_inputs(tiny_llama()) == {"input_ids": (1, TOKENS)}   # its position table is shorter than 512
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                                                       d_kv=16, vocab_size=100))
    assert default_inputs(t5) == {"input_ids": (1, 512), "decoder_input_ids": (1, 512)}
    with torch.device("meta"):
        seg = transformers.SegformerModel(transformers.SegformerConfig(hidden_sizes=[8, 16, 32, 64], depths=[1] * 4))
    assert default_inputs(seg) == {"pixel_values": (1, 3, 512, 512)}   # no image_size: 512
    count = count_flops(tiny_vit())
    assert count.defaults and count.inputs == {"pixel_values": (1, 3, 32, 32)} and count.complete
    problem = build_problem(tiny_vit(), {"cpu": 10**9}, inputs="default")   # the plan says which it used
    assert problem.flops.inputs == {"pixel_values": (1, 3, 32, 32)} and sum(problem.node_flops) == count.total
    with pytest.raises(InvalidOption, match="pass inputs"):
        default_inputs(nn.Linear(2, 2))


def test_a_model_on_meta_runs_as_it_is_and_keeps_no_hook():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    count = count_flops(model, {"input": torch.empty(2, 4, device="meta")})
    assert not count.copied and count.total == 2 * 2 * 4 * 4
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(InvalidOption, match="shape of positive ints"):
        count_flops(model, {"input": (2, "x")})


def test_estimate_with_inputs_follows_the_counted_flops():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    profile = Profile(cpu_memory=1e15, cpu_op_latency=0)   # reads and ops free: the compute term alone
    seconds = {}
    for rows in (512, 4096):
        problem = build_problem(model, {"cpu": 10**9}, inputs={"input": (rows, 256)}, profile=profile)
        assert problem.flops.total == 2 * 2 * rows * 256 * 256
        seconds[rows] = estimate(problem, {"": "cpu"}).seconds
        written = sum(problem.flops.written.values()) / profile.cpu_memory   # the ReLU's output: 1e-15 s a byte
        assert sum(problem.flops.pointwise.values()) == 0
        assert seconds[rows] == pytest.approx(problem.flops.total / profile.cpu_flops + written, rel=1e-9)
    assert seconds[4096] == pytest.approx(8 * seconds[512], rel=1e-9)
    plain = build_problem(model, {"cpu": 10**9}, profile=profile)   # without inputs: 2 x params x tokens
    assert plain.flops is None
    assert estimate(plain, {"": "cpu"}).seconds == pytest.approx(2 * 2 * (256 * 256 + 256) * 512 / 1e12, rel=1e-9)


def test_tensor_seconds_the_ilp_prices_with_follow_the_counted_flops_too():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    for inputs in (None, {"input": (4096, 256)}):
        problem = build_problem(model, {0: 10**6, "cpu": 10**9}, inputs=inputs)
        for device_map, device in (({"": 0}, 0), ({"": "cpu"}, "cpu")):
            summed = sum(tensor_seconds(problem, device, problem.profile, problem.graph.tensors[t], device)
                         for t in range(len(problem.graph.tensors)))
            assert summed == pytest.approx(estimate(problem, device_map).seconds, rel=1e-9)
    ops, written = sum(problem.flops.ops.values()), sum(problem.flops.written.values())
    assert estimate(problem, {"": 0}).seconds == pytest.approx(
        problem.flops.total / problem.profile.accelerator_flops + ops * problem.profile.accelerator_op_latency
        + written / problem.profile.accelerator_memory)


def test_inputs_option_is_checked():
    with pytest.raises(InvalidOption, match="inputs must map"):
        PlanOptions(inputs=(1, 512))
    with pytest.raises(InvalidOption, match="inputs must map"):
        PlanOptions(inputs={})
    with pytest.raises(InvalidOption, match="or be 'default'"):
        PlanOptions(inputs="defaults")
    with pytest.raises(InvalidOption, match="inputs must map"):
        PlanOptions(inputs=torch.zeros(1, 2))
    assert PlanOptions(inputs="default").inputs == "default"


def test_a_per_tensor_time_past_an_int64_of_femtoseconds_does_not_wrap():
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)   # 16.8 M elements x 1,024 FLOP at 1 MFLOP/s: 17,180 s
    problem = build_problem(model, {"cpu": 10**12}, profile=Profile(cpu_flops=1e6))
    expected = (4096 * 4096 + 4096) * 2 * 512 / 1e6
    assert estimate(problem, {"": "cpu"}).seconds == pytest.approx(expected, rel=1e-12)


def test_profile_load_and_a_profile_path_as_option(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"cpu_flops": 5e10, "disk_read": 2e9}))
    assert Profile.load(path) == Profile(cpu_flops=5e10, disk_read=2e9)
    options = PlanOptions(profile=str(path))
    assert options.profile == Profile(cpu_flops=5e10, disk_read=2e9)   # loaded once, here
    result = allocator.plan(nn.Linear(4, 4), {"cpu": 1000}, profile=str(path))
    assert result.cost == estimate(build_problem(nn.Linear(4, 4), {"cpu": 1000}, profile=Profile.load(path)),
                                   result.device_map)
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(InvalidOption, match="expected an object of Profile fields"):
        PlanOptions(profile=str(tmp_path / "bad.json"))
    with pytest.raises(InvalidOption, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")
