"""Judging a device map: its runs, units and tie groups, the memory it needs per device, the runtime rules it keeps
(:func:`~allocator.evaluate.validate.check`) and what it costs per forward (:func:`~allocator.evaluate.cost.estimate`).

Strategies read these; nothing here imports a strategy.
"""
