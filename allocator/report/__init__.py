"""What a plan says about itself: the "why" of :meth:`allocator.Plan.explain`, rendered from its decisions."""
