"""allocator.parallel: the exact partitioner against brute force, block classes and pipeline splits on real
architectures (meta-device zoo), and two real processes over gloo on CPU: FSDP2 (apply_fully_shard) and FSDP1
(fsdp_wrap_policy) training steps equal to one process, and a 2-stage GPipe pipeline built from pipeline_split_spec
giving the logits of one process (both within the float tolerance of ``models.TOLERANCE``)."""

import copy
import datetime
import functools
import itertools
import multiprocessing
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from allocator.model import zoo
from allocator.parallel import block_classes, contiguous_min_max, fsdp_wrap_policy, pipeline_split_spec
from allocator.parallel.fsdp import _shard_order
from allocator.errors import InfeasiblePlacement, InvalidBudget, InvalidModel, InvalidOption
from allocator.model import build_graph
from allocator.model.blocks import find_layers, infer_blocks
from models import assert_same_output


@functools.cache
def _zoo(name):
    """One shared meta-device build per name; tests only read these."""
    return zoo.build(name)


# ------------------------------------------------------------------------------------- contiguous_min_max
def _splits(n_items, n):
    """Every split of ``n_items`` items into ``n`` contiguous non-empty parts, as cut tuples."""
    return itertools.combinations(range(1, n_items), n - 1)


def _parts(sizes, cuts):
    bounds = [0, *cuts, len(sizes)]
    return [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]


def _fits(sizes, cuts, capacities):
    return capacities is None or all(c is None or s <= c for s, c in zip(_parts(sizes, cuts), capacities))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=9), st.data())
def test_contiguous_min_max_is_the_brute_force_optimum(sizes, data):
    n = data.draw(st.integers(1, len(sizes)), label="n")
    capacities = data.draw(st.none() | st.lists(st.none() | st.integers(0, 120), min_size=n, max_size=n),
                           label="capacities")
    feasible = [c for c in _splits(len(sizes), n) if _fits(sizes, c, capacities)]
    unconstrained = min(max(_parts(sizes, c)) for c in _splits(len(sizes), n))
    if not feasible:
        with pytest.raises(InfeasiblePlacement) as error:
            contiguous_min_max(sizes, n, capacities=capacities)
        assert error.value.minimum == unconstrained
        return
    cuts = contiguous_min_max(sizes, n, capacities=capacities)
    best = min(max(_parts(sizes, c)) for c in feasible)
    assert _fits(sizes, cuts, capacities)
    assert max(_parts(sizes, cuts)) == best
    # the documented tie-break: among optimal splits, the last part shortest, then the one before it, ...
    optimal = [c for c in feasible if max(_parts(sizes, c)) == best]
    assert tuple(cuts) == max(optimal, key=lambda c: c[::-1])


def test_contiguous_min_max_edge_cases():
    assert contiguous_min_max([7], 1) == []
    assert contiguous_min_max([1, 2, 3], 3) == [1, 2]
    assert contiguous_min_max([0, 0, 0, 0], 2) == [3]
    assert contiguous_min_max([10**15, 1, 10**15], 2) == [2]
    assert contiguous_min_max(range(1, 101), 4) == [50, 71, 87]  # parts 1275, 1281, 1272, 1222: optimal
    assert contiguous_min_max([5, 1, 1, 1], 2, capacities=[None, 2]) == [2]


@pytest.mark.parametrize("sizes, n, capacities, message", [
    ([], 1, None, "empty"),
    ([1, 2], 0, None, r"\[1, 2\]"),
    ([1, 2], 3, None, r"\[1, 2\]"),
    ([1, 2], True, None, r"\[1, 2\]"),
    ([1, -2], 1, None, "non-negative"),
    ([1, 2.5], 1, None, "non-negative ints"),
    ([1, True], 1, None, "non-negative ints"),
    ([1, 2], 2, [3], "one bound per part"),
    ([1, 2], 2, [3, -1], "non-negative"),
])
def test_contiguous_min_max_rejects_bad_input(sizes, n, capacities, message):
    with pytest.raises(InvalidOption, match=message):
        contiguous_min_max(sizes, n, capacities=capacities)


def test_contiguous_min_max_infeasible_states_the_minimum():
    with pytest.raises(InfeasiblePlacement, match="at least 6") as error:
        contiguous_min_max([3, 3, 3, 3], 2, capacities=[5, 5])
    assert error.value.minimum == 6


# ------------------------------------------------------------------------------------------ block classes
@pytest.mark.parametrize("name, expected", [
    ("llama-8b", {"LlamaDecoderLayer": 32}),
    ("t5-base", {"T5Block": 24}),
    # llava declares CLIPTextEmbeddings too, which its vision tower has no instance of
    ("llava-1.5-7b", {"CLIPVisionEmbeddings": 1, "CLIPEncoderLayer": 24, "LlamaDecoderLayer": 32}),
    ("wav2vec2-base", {"Wav2Vec2NoLayerNormConvLayer": 6, "Wav2Vec2EncoderLayer": 12}),  # declares none: inferred
])
def test_fsdp_wrap_policy_resolves_classes_found_in_the_model(name, expected):
    model = _zoo(name)
    classes = block_classes(model)
    assert [c.__name__ for c in classes] == list(expected)
    if name == "wav2vec2-base":
        assert set(expected) == infer_blocks(model)
    instances = {type(m).__name__: type(m) for m in model.modules()}
    assert all(instances[c.__name__] is c for c in classes)  # the model's own class objects, not look-alikes
    policy = fsdp_wrap_policy(model)
    wrapped = [type(m).__name__ for m in model.modules() if policy(m, recurse=False, nonwrapped_numel=0)]
    assert {c: wrapped.count(c) for c in expected} == expected and len(wrapped) == sum(expected.values())
    assert set(policy._run_policy(model, set(), {})) == {  # what FSDP1 wraps (besides the root)
        m for m in model.modules() if type(m).__name__ in expected}


def test_shard_order_puts_inner_blocks_before_outer_and_the_root_last():
    model = _zoo("mamba-130m")  # declares MambaBlock and the MambaMixer inside it
    order = _shard_order(model)
    modules = dict(model.named_modules())
    assert order[-1] == "" and len(order) == 1 + 2 * 24
    assert {type(modules[n]).__name__ for n in order[:-1]} == {"MambaBlock", "MambaMixer"}
    position = {n: i for i, n in enumerate(order)}
    for n in order[:-1]:
        parent = n.rsplit(".", 1)[0]
        if parent in position:
            assert position[n] < position[parent], n  # fully_shard children before their parents


def test_block_classes_rejects_models_without_blocks():
    with pytest.raises(InvalidModel, match="no repeated blocks"):
        block_classes(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)))
    with pytest.raises(InvalidModel, match="torch.nn.Module"):
        block_classes("llama")


# ---------------------------------------------------------------------------------------- pipeline splits
def _optimum(sizes, n):
    """Smallest largest part over contiguous splits, by an O(n * N^2) dynamic programme (independent of the
    binary search under test)."""
    prefix = list(itertools.accumulate(sizes, initial=0))
    best = [0] + [float("inf")] * len(sizes)  # best[i]: first i items in j parts
    for j in range(1, n + 1):
        best = [float("inf")] * j + [
            min(max(best[k], prefix[i] - prefix[k]) for k in range(j - 1, i)) for i in range(j, len(sizes) + 1)
        ]
    return best[-1]


@pytest.mark.parametrize("name, n_stages", [
    ("llama-8b", 4), ("t5-base", 3), ("llava-1.5-7b", 4), ("gpt2", 2), ("swin-tiny", 3), ("whisper-small", 5),
    ("mixtral-8x7b", 8), ("qwen2-vl-2b", 3),
])
def test_pipeline_split_spec_on_zoo_models(name, n_stages):
    from torch.distributed.pipelining import SplitPoint

    model = _zoo(name)
    split = pipeline_split_spec(model, n_stages)
    blocks = [b for _, names in find_layers(model) for b in names]
    assert [b for stage in split.stages for b in stage] == blocks and all(split.stages)  # contiguous, in order
    assert split.split_spec == {stage[0]: SplitPoint.BEGINNING for stage in split.stages[1:]}
    bounds = list(itertools.accumulate(map(len, split.stages), initial=0))
    assert split.stage_bytes == tuple(sum(split.block_bytes[a:b]) for a, b in zip(bounds, bounds[1:]))
    graph = build_graph(model)
    assert all(c >= graph.size[graph.node_index[b]] for b, c in zip(blocks, split.block_bytes))
    if not graph.all_tie_groups():
        assert sum(split.block_bytes) == graph.total  # every byte charged once
    assert split.largest == _optimum(split.block_bytes, n_stages)
    assert split.largest <= sum(split.block_bytes) / n_stages + max(split.block_bytes)  # within one block of even
    assert f"{len(blocks)} blocks in {n_stages} stages" in split.explain()


def test_pipeline_split_spec_charges_tied_embeddings_to_both_ends():
    model = _zoo("gpt2")  # lm_head.weight is transformer.wte.weight
    split = pipeline_split_spec(model, 2)
    graph = build_graph(model)
    wte = graph.size[graph.node_index["transformer.wte"]]
    block = graph.size[graph.node_index["transformer.h.0"]]
    assert split.block_bytes[0] >= block + wte and split.block_bytes[-1] >= block + wte
    assert sum(split.block_bytes) == graph.total + wte  # replicated on the last stage, as a pipeline does


class _TwoStacks(nn.Module):
    """embed | enc x 2 | mid | dec x 2 | head: what lies between and around the stacks is charged by the rule."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 160 B
        self.enc = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))  # 80 B each
        self.mid = nn.Linear(4, 4, bias=False)  # 64 B
        self.dec = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 10)  # 200 B


def test_pipeline_split_spec_charges_parts_outside_blocks():
    split = pipeline_split_spec(_TwoStacks(), 2)
    assert split.block_bytes == (160 + 80, 80 + 64, 80, 80 + 200)
    assert split.stages == (("enc.0", "enc.1"), ("dec.0", "dec.1")) and split.stage_bytes == (384, 360)
    assert pipeline_split_spec(_TwoStacks(), 1).stage_bytes == (744,)
    assert pipeline_split_spec(_TwoStacks(), 2, dtype=torch.float16).stage_bytes == (192, 180)


def test_pipeline_split_spec_budgets():
    model = _TwoStacks()
    assert pipeline_split_spec(model, 2, stage_budgets=[10**6, "1MiB"]).stage_bytes == (384, 360)
    tight = pipeline_split_spec(model, 2, stage_budgets=[240, 1000])  # stage 0 only fits enc.0
    assert tight.stages == (("enc.0",), ("enc.1", "dec.0", "dec.1")) and tight.stage_bytes == (240, 504)
    assert "240 B of 240 B (100%)" in tight.explain()
    with pytest.raises(InfeasiblePlacement, match="at least 384 B") as error:
        pipeline_split_spec(model, 2, stage_budgets=[239, 1000])
    assert error.value.minimum == 384
    with pytest.raises(InvalidOption, match="one size per stage"):
        pipeline_split_spec(model, 2, stage_budgets=[1000])
    with pytest.raises(InvalidOption, match="sequence"):
        pipeline_split_spec(model, 2, stage_budgets="2GiB")
    with pytest.raises(InvalidBudget):
        pipeline_split_spec(model, 2, stage_budgets=[-1, 1000])


def test_pipeline_split_spec_rejects_bad_stage_counts():
    with pytest.raises(InvalidOption, match=r"\[1, 4\].*4 blocks"):
        pipeline_split_spec(_TwoStacks(), 5)
    with pytest.raises(InvalidOption):
        pipeline_split_spec(_TwoStacks(), 0)
    with pytest.raises(InvalidModel, match="no repeated blocks"):
        pipeline_split_spec(nn.Linear(2, 2), 1)


# ------------------------------------------------------------------------------- two processes over gloo
#: A small llama: float32, no KV cache (a DynamicCache in the output stops torch.export, hence pipeline()).
_LLAMA = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
)
_WORLD = 2
_TIMEOUT_S = 240


def _tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_LLAMA))


def _batch(shape, seed):
    return torch.randint(0, _LLAMA["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def _sgd_step(model, ids):
    """One training step on ``ids`` (the same batch on every rank); returns the loss."""
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return loss.detach()


def _check_fully_shard(rank):
    from torch.distributed.fsdp import FSDPModule

    from allocator.parallel import apply_fully_shard

    reference = _tiny_llama(seed=0)
    model = copy.deepcopy(reference)
    ids = _batch((2, 16), seed=1)
    loss_ref = _sgd_step(reference, ids)  # one process, no collective
    apply_fully_shard(model)
    sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    shapes = {n: (tuple(p.shape), tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    loss = _sgd_step(model, ids)
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # a collective: every rank
    return dict(loss=loss, loss_ref=loss_ref, params=params, sharded=sharded, shapes=shapes,
                params_ref={n: p.detach() for n, p in reference.named_parameters()})


def _check_wrap_policy(rank):
    from torch.distributed.fsdp import FullyShardedDataParallel

    reference = _tiny_llama(seed=0)
    model = copy.deepcopy(reference)
    ids = _batch((2, 16), seed=1)
    loss_ref = _sgd_step(reference, ids)
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp_wrap_policy(model), device_id=torch.device("cpu"), use_orig_params=True
    )
    units = [name for name, m in wrapped.named_modules() if isinstance(m, FullyShardedDataParallel)]
    loss = _sgd_step(wrapped, ids)
    with FullyShardedDataParallel.summon_full_params(wrapped):
        params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in wrapped.named_parameters()}
    return dict(loss=loss, loss_ref=loss_ref, params=params, units=units,
                params_ref={n: p.detach() for n, p in reference.named_parameters()})


def _check_pipeline(rank):
    from torch.distributed.pipelining import ScheduleGPipe, build_stage, pipeline

    model = _tiny_llama(seed=2).eval()
    split = pipeline_split_spec(model, _WORLD)
    ids = _batch((4, 16), seed=3)
    microbatches = ids.chunk(2)
    with torch.no_grad():
        expected = torch.cat([model(input_ids=chunk).logits for chunk in microbatches])
        whole_batch = model(input_ids=ids).logits
    pipe = pipeline(copy.deepcopy(model), mb_args=(microbatches[0],), split_spec=split.split_spec)
    stage_module = pipe.get_stage_module(rank)
    stage = build_stage(stage_module, rank, pipe.info(), torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=len(microbatches))
    with torch.no_grad():
        logits = schedule.step(ids) if rank == 0 else schedule.step()
    return dict(stages=split.stages, stage_params=[n for n, _ in stage_module.named_parameters()],
                logits=logits, expected=expected, whole_batch=whole_batch)


_CHECKS = {"fsdp2": _check_fully_shard, "fsdp1": _check_wrap_policy, "pipeline": _check_pipeline}


def _worker(rank, store, out_dir):
    """One rank: every check in turn, each result (or its traceback) saved to ``out_dir/rank<rank>.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two cores; the single-process references run with the same setting
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=_WORLD,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for name, check in _CHECKS.items():
            start = time.perf_counter()
            try:
                results[name] = check(rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - start
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _run_ranks(out):
    """Run :func:`_worker` on ``_WORLD`` local processes; kills them and fails if they outlive ``_TIMEOUT_S``."""
    import torch.multiprocessing as mp

    # the ranks fork from a server that imported these once, instead of each importing torch and transformers
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch._dynamo", "torch.export", "torch.distributed.fsdp", "torch.distributed.pipelining",
         "transformers.models.llama.modeling_llama", "allocator.parallel", _worker.__module__])
    context = mp.start_processes(_worker, args=(str(out / "store"), str(out)), nprocs=_WORLD, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + _TIMEOUT_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"the {_WORLD} gloo ranks did not finish within {_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The results of two gloo ranks on localhost, one dict per rank; the processes are gone when it returns.

    Under pytest-xdist the first worker to ask runs the ranks and the others read its results (one run per
    session, not one per worker)."""
    import torch.distributed as dist
    from filelock import FileLock

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this session's directory, common to its workers
    out = shared / "gloo-ranks"
    with FileLock(str(shared / "gloo-ranks.lock")):
        if not out.exists():
            out.mkdir()
            _run_ranks(out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(_WORLD)]


def _result(ranks, check, rank):
    result = ranks[rank][check]
    if "error" in result:
        pytest.fail(f"{check} failed on rank {rank}:\n{result['error']}")
    return result


def _layers():
    return [f"model.layers.{i}" for i in range(_LLAMA["num_hidden_layers"])]


def _assert_same_params(got, want):
    assert list(got) == list(want)
    for n in want:
        assert_same_output(got[n], want[n], msg=f"parameter {n} differs after one SGD step")


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("rank", range(_WORLD))
def test_fully_shard_step_equals_one_process(ranks, rank):
    result = _result(ranks, "fsdp2", rank)
    assert result["sharded"] == ["", *_layers()]  # the root and every block, nothing else
    full, local = result["shapes"]["model.layers.0.mlp.up_proj.weight"]
    assert full == (64, 32) and local == (32, 32)  # really sharded over the 2 ranks (Shard(0))
    assert_same_output(result["loss"], result["loss_ref"])
    _assert_same_params(result["params"], result["params_ref"])


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("rank", range(_WORLD))
def test_fsdp1_wrap_policy_step_equals_one_process(ranks, rank):
    result = _result(ranks, "fsdp1", rank)
    assert result["units"] == ["", *(f"_fsdp_wrapped_module.{layer}" for layer in _layers())]
    assert_same_output(result["loss"], result["loss_ref"])
    _assert_same_params(result["params"], result["params_ref"])


@pytest.mark.subprocess
@pytest.mark.slow
def test_pipeline_from_split_spec_gives_one_process_logits(ranks):
    first, last = _result(ranks, "pipeline", 0), _result(ranks, "pipeline", 1)
    # embeddings + 2 layers | 1 layer + norm + head: the two embedding-sized ends make 2 | 1 the balanced split
    assert first["stages"] == (("model.layers.0", "model.layers.1"), ("model.layers.2",))
    assert first["logits"] is None  # only the last stage returns the output
    assert_same_output(last["logits"], last["expected"])  # microbatch by microbatch
    torch.testing.assert_close(last["logits"], last["whole_batch"], rtol=0, atol=1e-6)
    for result, stage, other in ((first, 0, 1), (last, 1, 0)):  # each rank holds its stage's blocks only
        names = set(result["stage_params"])
        assert all(any(n.startswith(b + ".") for n in names) for b in result["stages"][stage])
        assert not any(n.startswith(b + ".") for b in result["stages"][other] for n in names)
    assert "model.embed_tokens.weight" in first["stage_params"] and "lm_head.weight" in last["stage_params"]
