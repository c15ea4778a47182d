"""The CPU kernels behind a level's matrix products, in one place.

* :mod:`workers.kernels.products` — the product a level uses for each weight
  (:func:`~workers.kernels.products.linear_product`): oneDNN over a prepacked copy, MKL over a
  column-major weight, the few-row kernel, or plain ``F.linear``. Every faster path is chosen by
  a check that runs it on a probe against ``F.linear`` and falls back to ``F.linear`` where its op
  is missing or disagrees.
* :mod:`workers.kernels.few_rows` — float32 products for passes of a few rows on an AVX2 CPU,
  from ``few_rows.c``, built with the package as an optional extension (``setup.py``); a machine
  that could not build it gets torch's products, logged once.
* :mod:`workers.kernels.int4` — torch's CPU weight-only int4 kernel over 4-bit groups, the
  products of a quantized level (:mod:`workers.quant`): checked on a probe when a level loads,
  and used up to the widest pass at which it measured faster than the level's float products.

Nothing here is compiled at run time. What each path costs is in docs/engine.md ("Batches
underneath") and the results log.
"""
