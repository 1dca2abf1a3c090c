"""Where allocator plugs into the libraries users already call: transformers' ``from_pretrained`` and accelerate's
``load_checkpoint_and_dispatch`` (:mod:`~allocator.integrations.transformers`: :func:`patch`)."""
