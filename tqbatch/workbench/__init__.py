"""The workbench: batch caches exercised in a serving loop, a real model and benchmarks.

The third room of tqbatch, beside the cache (``tqbatch.cache`` and its private
helpers) and the harness that judges any cache (``tqbatch.testing``). Arrows
run one way: the workbench uses both, the harness uses the cache, the cache
uses neither.

* ``serving``: a continuous-batching server loop over mlx-vlm model code,
  driven through one ``ModelAdapter`` (``TurboQuantLayersAdapter``: tqbatch's
  layer layout).
* ``serving_oracle``: per-request references checked against the caches that
  loop drives.
* ``request_oracle``: the request oracle under ``serving_oracle.ServingOracle``,
  the one judge of both serving loops (``model_matrix.Oracle`` is a
  ``ServingOracle`` that stops at the first failure), with what it uses:
  ``forward_capture`` (one forward's K/V and attention, captured by
  ``kv_ledger``, fed and checked), ``cache_rows`` (the reader of a cache's
  rows) and ``reference_attention`` (a row's reference attention).
* ``e2e``: ``tqbatch e2e``, continuous batching through a random-weight
  Qwen2 language model, checked by the cache oracle.
* ``bench``: ``tqbatch bench``'s workloads and timers, op and decode-step
  timings against mlx-lm's float16 ``BatchKVCache``; ``bench_report`` renders
  its rows (markdown tables against the goals, plots).
* ``model_matrix``: ``tqbatch models``, the cache as a drop-in inside tiny
  random-weight models of mlx-vlm's (``vlm_families``) and mlx-lm's
  (``lm_families``) own model classes, under a cache oracle fed from the K/V
  capture ``kv_ledger``; ``batch_generator_scenario`` drives mlx-lm's
  ``BatchGenerator`` under that oracle. Each family is a ``family.Family``
  (its config, its build, its library's cache rule), chosen by name from
  ``families``; ``tiny_config`` holds the config pieces both kinds share.
* ``local_model``: a tiny random-weight model directory with a tokenizer built
  locally, which ``mlx_vlm.server`` and ``mlx_lm.server`` load by path.
* ``server_process``, ``server_log``, ``http_oracle``, ``server_report``: the
  HTTP server oracle (real server processes; which cache served which request,
  from their log; each batched reply against its alone run; the tables).

Every language model is built here: the harness judges cache operations and
builds none (``tests/unit/test_import_direction.py`` holds it to that).
"""
