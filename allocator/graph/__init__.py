"""The model graph: everything a strategy needs to know about a model, extracted once.

:func:`build_graph` reads an ``nn.Module`` into a frozen :class:`ModelGraph`; strategies read the graph and never the
model. The package, bottom to top (each module imports only those above it in this list):

- :mod:`~allocator.graph.table`: immutable records and column tables (how the graph and the units are stored);
- :mod:`~allocator.graph.model`: the records and tables of a graph and :class:`ModelGraph`, what strategies read;
- :mod:`~allocator.graph.sizes`: bytes per dtype, a tensor's bytes under ``dtype`` / ``special_dtypes`` /
  ``size_fn``, subtree sums;
- :mod:`~allocator.graph.ties`: tie groups (shared tensors, declared tied keys) and the memory a declared tie shares;
- :mod:`~allocator.graph.no_split`: which classes plans keep whole (given, declared by sub-models, or inferred);
- :mod:`~allocator.graph.read`: the walk of the model and :func:`build_graph`, which applies the three rules above.

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
    :func:`allocator.runtime.streamed_chain`).
"""

from ..introspect import no_split_classes
from .model import ModelGraph, ModuleNode, Nodes, TensorNode, Tensors
from .read import build_graph
from .sizes import as_dtype, dtype_bytes

__all__ = ["ModuleNode", "TensorNode", "Nodes", "Tensors", "ModelGraph", "build_graph", "as_dtype", "dtype_bytes",
           "no_split_classes"]
