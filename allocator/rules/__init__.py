"""What accelerate's and transformers' code does, as small pure functions, each naming the code it follows.

- :mod:`~allocator.rules.dispatch`: what ``dispatch_model`` does with a map (main device, offloaded devices, where a
  module executes, what moves with an offloaded module);
- :mod:`~allocator.rules.loaders`: where the two loading paths (``from_pretrained``, ``load_checkpoint_and_dispatch``)
  differ;
- :mod:`~allocator.rules.versions`: the installed releases those rules depend on.
"""
