"""The CPU kernels behind a level's matrix products, in one place.

* :mod:`workers.kernels.products` — the product a level uses for each weight
  (:func:`~workers.kernels.products.linear_product`): oneDNN over a prepacked copy, MKL over a
  column-major weight, the few-row kernel, or plain ``F.linear``. Every faster path is chosen by
  a check that runs it on a probe against ``F.linear`` and falls back to ``F.linear`` where its op
  is missing or disagrees.
* :mod:`workers.kernels.few_rows` — float32 products for passes of a few rows on an AVX2 CPU,
  from ``few_rows.c``, built with the package as an optional extension (``setup.py``); a machine
  that could not build it gets torch's products, logged once.

Nothing here is compiled at run time. What each path costs is in docs/engine.md ("Batches
underneath") and the results log.
"""
