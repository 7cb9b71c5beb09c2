"""The server-like scenario through mlx-vlm's Qwen2 equals each request run alone."""

from __future__ import annotations

import pytest

from tqbatch.e2e import LOGITS_ATOL, REQUESTS, reference_run
from tqbatch.serving import ContinuousBatcher, Request

from .conftest import BITS, SEED, SPEC

UIDS = [uid for uid, _, _ in REQUESTS]


@pytest.mark.parametrize("uid", UIDS)
def test_greedy_tokens_equal_the_request_run_alone(scenario, uid):
    assert scenario.tokens_match[uid]


@pytest.mark.parametrize("uid", UIDS)
def test_logits_equal_the_request_run_alone(scenario, uid):
    # LOGITS_ATOL = 1e-4: rows hold the same packed codes as the request
    # alone, so only float32 summation order differs (measured ~4e-6); a
    # slot of padding or a shifted token costs 1e-3 or more.
    assert scenario.max_logit_diff[uid] <= LOGITS_ATOL


@pytest.mark.parametrize("uid", UIDS)
def test_extracted_caches_hold_the_request_and_decode_on(scenario, uid):
    assert scenario.extracted_lengths_ok[uid]
    assert scenario.resume_diff[uid] <= LOGITS_ATOL  # same reason as above


def test_references_have_no_near_ties(scenario):
    # Otherwise a token mismatch could come from rounding alone.
    assert scenario.min_reference_margin > 2 * LOGITS_ATOL


def test_every_batched_forward_checked_the_mask_at_every_layer(scenario):
    # F and G are prefilled alone (string "causal" mask, nothing to check);
    # every other forward is batched and checked at all layers.
    batched_forwards = scenario.forwards - 2
    assert scenario.mask_checks == batched_forwards * SPEC.num_layers


def test_scenario_exercises_every_server_operation(scenario):
    events = "\n".join(scenario.events)
    for what in ("left-padded", "right-padded", "merge", "extend", "trim", "decode"):
        assert what in events
    assert scenario.trimmed > 0
    # Someone left while others stayed (extract + filter), and everyone left.
    assert any("batch [A,B]" in e for e in scenario.events)
    assert scenario.events[-1].endswith("batch [-]")


def test_no_failures_reported(scenario):
    assert scenario.failures() == []


def test_left_padding_through_prepare_equals_requests_alone(model, impl):
    """``prepare(left_padding=...)`` on unpadded caches serves like the constructor."""
    prompts = {"p": [9, 8, 7, 6, 5, 4], "q": [11, 12], "r": [300, 301, 302, 303]}
    server = ContinuousBatcher(model, bits=BITS, seed=SEED, batch_cache_class=impl)
    try:
        requests = [Request(uid, p, 4) for uid, p in prompts.items()]
        server.admit_left_padded(requests, via_prepare=True)
        server.run_until_idle()
    finally:
        server.probe.remove()
    assert server.probe.checks == server.forwards * SPEC.num_layers
    for r in requests:
        ref = reference_run(
            model, r.prompt, 4, bits=BITS, seed=SEED, dense_layers=[SPEC.num_layers - 1]
        )
        assert r.tokens == ref.tokens
        for mine, alone in zip(r.logits, ref.logits):
            assert abs(mine - alone).max().item() <= LOGITS_ATOL  # reason at LOGITS_ATOL
