"""The oracles: what the target is compared with, and how closely.

``reference`` (mlx-lm's ``BatchKVCache`` in full precision and a
single-request ``TurboQuantKVCache`` per request, with ``reference_codecs``,
``codec_round_trip`` and ``packing``), ``numpy_model`` (what every row should
hold), ``generation`` (the K/V and queries written, from an op's seeds),
``rounding`` (which codes float rounding lets a correct quantizer choose),
``tolerances`` (how far two float computations may drift apart) and
``judges`` (every comparison of a cache's numbers with a reference).
"""
