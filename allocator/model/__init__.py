"""Reading a model: the graph, its blocks, sizes and ties, and what it needs beyond its weights.

:func:`build_graph` reads an ``nn.Module`` into a frozen :class:`ModelGraph`; strategies read the graph and never the
model. This is the only layer that touches ``torch.nn`` modules. The graph, bottom to top (each module imports only
those above it in this list):

- :mod:`~allocator.model.table`: immutable records and column tables (how the graph and the units are stored);
- :mod:`~allocator.model.graph`: the records and tables of a graph and :class:`ModelGraph`, what strategies read;
- :mod:`~allocator.model.sizes`: bytes per dtype, a tensor's bytes under ``dtype`` / ``special_dtypes`` /
  ``size_fn``, subtree sums;
- :mod:`~allocator.model.ties`: tie groups (shared tensors, declared tied keys) and the memory a declared tie shares;
- :mod:`~allocator.model.no_split`: which classes plans keep whole (given, declared by sub-models, or inferred);
- :mod:`~allocator.model.families`: what a model family adds (:class:`Family`: no-split classes, inferred blocks,
  routed experts, cache layers, declared ties, its loader), registered in :data:`FAMILIES`, found by
  :func:`family_of`;
- :mod:`~allocator.model.read`: the walk of the model and :func:`build_graph`, which applies the rules above, asking
  the model's family.

Beside it: :mod:`~allocator.model.blocks` (no-split classes, repeated blocks and stacks),
:mod:`~allocator.model.unwrap` (the model under its wrappers), :mod:`~allocator.model.flops` (FLOPs at the input
shapes), :mod:`~allocator.model.generation` (what ``generate`` needs: KV cache, logits, activations; the attention
modules that fill the cache in :mod:`~allocator.model.attention`),
:mod:`~allocator.model.quantization` (sizes of quantized weights), :mod:`~allocator.model.safetensors` and
:mod:`~allocator.model.checkpoint` (what a saved folder loads as), and :mod:`~allocator.model.zoo` (real transformers
architectures built on the meta device, from the catalogue in :mod:`~allocator.model.zoo_specs`).

Glossary
--------
node
    A module reached by ``named_children`` recursion from the root, named by its path (``""`` is the root).
    A module object reachable under two paths gives two nodes, exactly as ``named_children`` walks it.
tensor
    A parameter or buffer, named by its full path. When one tensor object has several names (tied weights),
    only its first name in ``named_parameters()`` order is *counted*; the others have ``counted == 0``,
    which is how accelerate's ``compute_module_sizes`` accounts shared storage.
streamed size
    The bytes a module's offload hook copies to the main device at its forward: its direct parameters (and
    direct persistent buffers with ``offload_buffers=True``). Hooks of nested modules are active together, so
    the room a subtree needs for streaming is the largest *sum along a root-to-leaf chain* (see
    :func:`allocator.evaluate.memory.streamed_chain`).
"""

from .blocks import no_split_classes
from .families import FAMILIES, Family, family_of
from .graph import ModelGraph, ModuleNode, Nodes, TensorNode, Tensors
from .read import build_graph
from .sizes import as_dtype, dtype_bytes

__all__ = ["ModuleNode", "TensorNode", "Nodes", "Tensors", "ModelGraph", "build_graph", "as_dtype", "dtype_bytes",
           "no_split_classes", "FAMILIES", "Family", "family_of"]
