import pytest
import torch
from torch import nn

import allocator
from allocator.errors import InvalidModel, InvalidOption
from allocator.model import build_graph, no_split_classes


class Block(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("mask", torch.ones(16, dtype=torch.bool), persistent=False)


class Tower(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])


class Outer(nn.Module):
    _no_split_modules = ["Outer"]

    def __init__(self):
        super().__init__()
        self.tower = Tower()
        self.head = nn.Linear(8, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(3))
        self.head.weight = self.tower.blocks[0].fc.weight  # tied across branches


def test_sizes_under_dtype_keep_int_and_bool():
    g = build_graph(Outer(), dtype=torch.float16)
    block = g.node_index["tower.blocks.1"]
    # fc: 72 floats -> 144 B in fp16; int64 buffer 32 B kept; bool buffer 16 B real (accelerate counts 2 B)
    assert g.size[block] == 144 + 32 + 16
    assert g.size_accelerate[block] == 144 + 32 + 2
    # the tied head counts nothing (its weight is counted under its first name)
    assert g.size[g.node_index["head"]] == 0
    assert g.total == 2 * (144 + 32 + 16) + 3 * 2


def test_special_dtypes_and_size_fn():
    g = build_graph(Outer(), special_dtypes={"tower.blocks.0.fc.weight": torch.int8})
    assert g.tensors[g.tensor_index["tower.blocks.0.fc.weight"]].nbytes == 64
    g = build_graph(Outer(), size_fn=lambda name, t: 1 if name.endswith("bias") else None)
    assert g.tensors[g.tensor_index["tower.blocks.0.fc.bias"]].nbytes == 1
    with pytest.raises(InvalidOption, match="special_dtypes"):
        build_graph(Outer(), special_dtypes={"nope.weight": torch.int8})
    with pytest.raises(InvalidOption, match="dtype"):
        build_graph(Outer(), dtype="float17")


def test_ties_no_split_buffers_and_order():
    model = Outer()
    g = build_graph(model, no_split_module_classes=["Linear"])
    assert g.tied_groups == (("head.weight", "tower.blocks.0.fc.weight"),)
    assert g.no_split == {"Outer", "Block", "Linear"}  # caller's united with every sub-model's
    assert no_split_classes(model) == {"Outer", "Block"}
    mask = g.tensors[g.tensor_index["tower.blocks.0.mask"]]
    assert not mask.persistent and not mask.is_param
    assert [n.name for n in g.nodes][:4] == ["", "tower", "tower.blocks", "tower.blocks.0"]
    assert g.tensors[0].name == "scale"  # root's own parameter
    assert g.direct_param_bytes(g.node_index["head"]) == 256


def test_declared_ties_are_kept_when_not_shared():
    model = Outer()
    model.head.weight = nn.Parameter(torch.ones(8, 8))  # untie
    model.all_tied_weights_keys = {"head.weight": "tower.blocks.1.fc.weight"}
    g = build_graph(model)
    assert g.tied_groups == ()
    assert g.declared_ties == (("head.weight", "tower.blocks.1.fc.weight"),)


def test_shared_module_appears_under_both_paths_counted_once():
    shared = nn.Linear(4, 4)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    g = build_graph(model)
    assert g.nodes[g.node_index["b.0"]].alias_of == g.node_index["a.0"]
    assert g.size[g.node_index["a"]] == 80 and g.size[g.node_index["b"]] == 0


def test_meta_model_and_inputs_untouched():
    with torch.device("meta"):
        model = Outer()
    before = {n: (p.device, p.dtype, p.shape) for n, p in model.named_parameters()}
    budget = {0: 300, "cpu": 10_000}
    snapshot = dict(budget)
    allocator.plan(model, budget, dtype="float16")
    assert {n: (p.device, p.dtype, p.shape) for n, p in model.named_parameters()} == before
    assert budget == snapshot


def test_bad_models():
    with pytest.raises(InvalidModel, match="nn.Module"):
        build_graph({"not": "a model"})
    loop = nn.Sequential(nn.Linear(2, 2))
    loop.add_module("self", loop)
    with pytest.raises(InvalidModel, match="cycle"):
        build_graph(loop)


def test_records_read_as_attributes_and_stay_immutable():
    import copy
    import gc
    import pickle

    from allocator.model import ModuleNode, TensorNode

    g = build_graph(Outer())
    t = g.tensors[g.tensor_index["tower.blocks.0.mask"]]
    assert (t.name, t.local, t.is_param, t.persistent, t.numel, t.nbytes) == ("tower.blocks.0.mask", "mask", False,
                                                                              False, 16, 16)
    assert t._index == g.tensor_index[t.name] and t.counted == t.nbytes
    node = g.nodes[g.node_index["tower.blocks.0"]]
    assert (node.cls, g.nodes[node.parent].name, node.alias_of) == ("Block", "tower.blocks", -1)
    with pytest.raises(AttributeError):
        t.nbytes = 0
    assert t._replace(storage=0).storage == 0 and t.storage == t._index
    assert pickle.loads(pickle.dumps(node)) == node and copy.deepcopy(t) == t
    assert TensorNode(t.name, t.module, t.local, t.is_param, t.persistent, t.numel, t.nbytes, t.nbytes_accelerate,
                      t.canonical) == t._replace(storage=-1, _index=-1)  # the defaults
    assert ModuleNode(**dict(zip(ModuleNode._fields, node))) == node
    with pytest.raises(TypeError):
        ModuleNode("x", "Linear")
    try:
        for enabled in (True, False):  # the collector is paused while building, and left as the caller had it
            (gc.enable if enabled else gc.disable)()
            allocator.build_problem(Outer(), {"cpu": 10_000})
            assert gc.isenabled() == enabled
    finally:
        gc.enable()


def _reference_records(model):
    """(name, class, parent name, child names, direct tensor names) of every path, from torch's own generators."""
    out = []

    def walk(prefix, module, parent):
        children = list(module.named_children())
        tensors = [n for n, _ in module.named_parameters(recurse=False)]
        tensors += [n for n, _ in module.named_buffers(recurse=False)]
        path = lambda local: f"{prefix}.{local}" if prefix else local  # noqa: E731
        out.append((prefix, type(module).__name__, parent, [path(c) for c, _ in children], [path(t) for t in tensors]))
        for local, child in children:
            walk(path(local), child, prefix)

    walk("", model, None)
    return out


def test_columns_give_the_records_torch_walks():
    shared = nn.Linear(4, 4)
    model = nn.ModuleDict({"outer": Outer(), "a": nn.Sequential(shared, nn.ReLU()), "b": nn.Sequential(shared)})
    g = build_graph(model)
    nodes, tensors = g.nodes, g.tensors
    got = [(n.name, n.cls, nodes.name[n.parent] if n.parent >= 0 else None, [nodes.name[c] for c in n.children],
            [tensors.name[t] for t in n.params + n.buffers]) for n in nodes]
    assert got == _reference_records(model)
    for i in range(len(nodes)):
        assert nodes.children(i) == tuple(j for j in range(len(nodes)) if nodes.parent[j] == i)
        below = [j for j in range(i + 1, len(nodes)) if _is_below(nodes.parent, j, i)]
        assert nodes.end[i] == i + 1 + len(below)  # the subtree is one preorder range
        assert list(nodes.tensors_of(i)) == list(nodes[i].params + nodes[i].buffers)
    assert [t.name for t in tensors] == list(tensors.name) == list(g.tensor_index)
    assert nodes[-1] == nodes[len(nodes) - 1] and nodes[1:3] == (nodes[1], nodes[2])
    assert tensors[-1]._index == len(tensors) - 1
    with pytest.raises(IndexError):
        nodes[len(nodes)]
    with pytest.raises(IndexError):
        tensors[len(tensors)]


def _is_below(parent, j, i):
    while j >= 0:
        j = parent[j]
        if j == i:
            return True
    return False


def test_columns_are_read_only_and_survive_pickling():
    import pickle

    g = build_graph(Outer())
    with pytest.raises(TypeError):
        g.nodes.parent[0] = 5         # int64 columns are read-only views
    with pytest.raises(TypeError):
        g.tensors.nbytes[0] = 0
    with pytest.raises(AttributeError):
        g.nodes.parent = ()
    with pytest.raises(AttributeError):
        g.tensors.name = ()
    again = pickle.loads(pickle.dumps(g))
    assert again == g and list(again.nodes) == list(g.nodes) and list(again.tensors) == list(g.tensors)
    assert again.tensor_index["tower.blocks.1.fc.bias"] == g.tensor_index["tower.blocks.1.fc.bias"]


def test_tensor_index_is_a_mapping_without_a_table():
    model = Outer()
    odd = nn.Linear(2, 2)
    odd._parameters["a.b"] = nn.Parameter(torch.ones(3))  # a local name with a dot: only a table can find it
    model.add_module("odd", odd)
    g = build_graph(model)
    index = g.tensor_index
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert set(names) <= set(index) and len(index) == len(g.tensors)
    for k, name in enumerate(g.tensors.name):
        assert index[name] == k and name in index
    assert index["odd.a.b"] == g.tensors.name.index("odd.a.b")
    for missing in ("tower", "tower.blocks.0.fc.nope", "", "nope.weight", 3, None):
        assert missing not in index and index.get(missing) is None


def test_sizes_beyond_int64_from_a_size_fn():
    huge = 2**70  # a size_fn may say anything; the columns fall back to Python integers
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    g = build_graph(model, size_fn=lambda name, t: huge if name == "1.weight" else None)
    from allocator.evaluate.runs import columns
    from allocator.evaluate.validate import check

    cols = columns(g)
    assert g.total == huge + 32 and cols.sum_counted[-1] == g.total  # 24 B + 8 B of bias besides
    assert cols.moving(False).sum_nbytes[-1] == huge + 32
    p = allocator.build_problem(model, {"cpu": huge * 2}, size_fn=lambda name, t: huge if name == "1.weight" else None)
    assert check(p, {"": "cpu"})[1].peak["cpu"] == huge + 32


def test_a_large_graph_keeps_no_object_per_module():
    """The graph is columns: the objects a garbage collection walks do not grow with the model."""
    import gc

    def tracked_after(n):
        model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(n)))
        gc.collect()
        before = len(gc.get_objects())
        g = build_graph(model)
        gc.collect()
        assert len(g.nodes) == n + 1
        return len(gc.get_objects()) - before

    assert tracked_after(2000) - tracked_after(20) < 20


def test_tensor_index_of_a_module_with_many_tensors_is_not_quadratic():
    import time

    from allocator.model.graph import _SCAN

    n = 20_000
    model = nn.Module()
    model.scales = nn.ParameterList(nn.Parameter(torch.ones(1)) for _ in range(n))
    g = build_graph(model)
    index = g.tensor_index
    start = time.process_time()
    assert all(index[f"scales.{k}"] == k for k in range(n))  # a scan per name would be n^2 / 2 = 2e8 comparisons
    assert time.process_time() - start < 5.0
    assert "scales.nope" not in index and n > _SCAN


@pytest.mark.parametrize("name", ["gpt2", "t5-base"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_graph_with_sizes_zeroed_is_the_graph_read_with_them_at_zero(name, dtype):
    """``model.graph.zeroed``: the sizes a read with a ``size_fn`` that gives some tensors 0 bytes makes, tied
    tensors (a shared one zeroed, its second name not counted) and declared ties included, without a second read."""
    from allocator.integrations.placement_params import zero_size_for
    from allocator.model import zoo
    from allocator.model.graph import zeroed

    model = zoo.build(name)
    graph = build_graph(model, dtype=dtype, declared_as_shared=True)
    names = [n for n in graph.tensors.name if ".1." in n][:5] + [graph.tensors.name[0], graph.tensors.name[-1]]
    names += [n for group in graph.tied_groups for n in group][:1]
    ours = zeroed(graph, names)
    read = build_graph(model, dtype=dtype, declared_as_shared=True, size_fn=zero_size_for(names, None))
    assert ours.size == read.size and ours.total < graph.total
    assert ours.size_accelerate == read.size_accelerate
    assert list(ours.tensors.nbytes) == list(read.tensors.nbytes)
    assert list(ours.tensors.nbytes_accelerate) == list(read.tensors.nbytes_accelerate)
    assert ours.tied_groups == read.tied_groups and ours.nodes is graph.nodes
