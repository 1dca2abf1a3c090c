"""The building blocks strategies propose from: accelerate's algorithm (:mod:`allocator.search.accelerate`), first
fit and its room (:mod:`allocator.search.first_fit`, :mod:`allocator.search.room`), the fills of ``reserve`` and
``backfill`` as candidate generators (:mod:`allocator.search.fills`), the balanced partition
(:mod:`allocator.search.partition`) and the CP-SAT model (:mod:`allocator.search.cpsat`). Nothing here ranks plans
or knows the contract: that is :mod:`allocator.judge`."""
