"""The judge of one problem: the witness (baseline, the contract's main device and the plan that proved it, the
floor; :mod:`allocator.judge.witness`), the contract's three rules (:mod:`allocator.judge.contract`) and the ranking
and selection of candidates (:mod:`allocator.judge.ranking`). Strategies propose candidates; the judge decides."""
