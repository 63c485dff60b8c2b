"""The layer-wise KV streaming arithmetic (costmodel/article/layerwise.py) against its closed forms, and the
cost model's use of it for a real model (what `pdserve cost` prints)."""

from __future__ import annotations

import pytest

from costmodel.article import cost_model as cm
from costmodel.article.layerwise import (
    DEFAULT_GROUP_OVERHEAD_S,
    DEFAULT_OPEN_S,
    LinkSpec,
    bulk_exposed_s,
    groups_of,
    layerwise_exposed_s,
    layerwise_gain_s,
    layerwise_threshold_tokens,
)

M, HW = cm.ARTICLE_MODEL, cm.ARTICLE_HW
OVERHEAD = DEFAULT_GROUP_OVERHEAD_S  # per-group overhead of the links below


def test_groups_of():
    assert groups_of(80, 2) == 40
    assert groups_of(3, 2) == 2  # the last group holds what is left
    assert groups_of(4, 99) == 1 and groups_of(4, 0) == 4  # clamped to [1, num_layers]


def test_a_link_that_keeps_up_leaves_one_groups_share():
    # 1 GB at 100 GB/s in 10 groups: 1 ms + overhead a group, far under the 100 ms the prefill
    # takes to write each group, so only the last group is left after the prefill
    b, p, g, link = 1e9, 1.0, 10, LinkSpec(100e9, OVERHEAD)
    assert layerwise_exposed_s(b, p, g, link) == pytest.approx(b / (g * link.bytes_per_s) + OVERHEAD)
    assert bulk_exposed_s(b, link) == pytest.approx(b / link.bytes_per_s + OVERHEAD)


def test_a_link_slower_than_the_prefill_leaves_the_backlog():
    # 10 GB at 1 GB/s while a 1 s prefill writes it: the link never idles after the first group
    b, p, g, link = 10e9, 1.0, 10, LinkSpec(1e9, OVERHEAD)
    want = b / link.bytes_per_s + g * OVERHEAD - p * (g - 1) / g
    assert layerwise_exposed_s(b, p, g, link) == pytest.approx(want)
    assert want < bulk_exposed_s(b, link)  # still less than pulling it all after the prefill


def test_a_busy_link_starts_the_recurrence_later():
    b, p, g, link = 1e9, 1.0, 10, LinkSpec(100e9, OVERHEAD)
    share = b / (g * link.bytes_per_s) + OVERHEAD
    assert layerwise_exposed_s(b, p, g, link, busy_s=0.0) == layerwise_exposed_s(b, p, g, link)
    assert layerwise_exposed_s(b, p, g, link, busy_s=0.5) == pytest.approx(share)  # absorbed by the slack
    # busy past the prefill's end: every group waits, then crosses back to back
    assert layerwise_exposed_s(b, p, g, link, busy_s=1.2) == pytest.approx(0.2 + g * share)


def test_gain_negative_for_a_tiny_prompt_positive_for_a_long_one_on_a_slow_link():
    link = LinkSpec.gbits(100, OVERHEAD)
    kvb, per_token, g = cm.kv_bytes_per_token(M), cm.prefill(M, HW, 4096).time_s / 4096, groups_of(80, 2)
    tiny = layerwise_gain_s(16 * kvb, 16 * per_token, g, link)
    long = layerwise_gain_s(4096 * kvb, 4096 * per_token, g, link)
    assert tiny < 0 < long
    # a 16-token prefill writes its 40 groups faster than 40 pulls' overheads drain: worse than
    # the stream's opening alone
    assert tiny < -DEFAULT_OPEN_S


def test_threshold_drops_as_the_link_slows():
    kvb, per_token, g = cm.kv_bytes_per_token(M), cm.prefill(M, HW, 4096).time_s / 4096, 40
    rates = [900e9, 50e9, 12.5e9, 1e9]  # NVLink, 400G IB, 100G IB, 8 Gbit/s
    found = [layerwise_threshold_tokens(kvb, per_token, g, LinkSpec(r, OVERHEAD)) for r in rates]
    assert all(a > b for a, b in zip(found, found[1:])), found
    for n, r in zip(found, rates):  # the shortest prompt that gains: one token less does not
        link = LinkSpec(r, OVERHEAD)
        assert layerwise_gain_s(n * kvb, n * per_token, g, link) > 0
        assert layerwise_gain_s((n - 1) * kvb, (n - 1) * per_token, g, link) <= 0


def test_cost_model_feeds_the_model_into_it():
    link = cm.LINKS["ib-100g"]
    got = cm.layerwise_kv_exposed_seconds(M, HW, 4096, link, layers_per_group=2)
    want = layerwise_exposed_s(
        4096 * cm.kv_bytes_per_token(M), cm.prefill(M, HW, 4096).time_s, 40, cm.stream_link(link)
    )
    assert got == want and got < cm.kv_transfer_seconds(M, 4096, link)
    # one group of every layer: nothing overlaps, the whole transfer (and one pull's cost) is left
    whole = cm.layerwise_kv_exposed_seconds(M, HW, 4096, link, layers_per_group=80)
    assert whole == pytest.approx(cm.kv_transfer_seconds(M, 4096, link) + OVERHEAD)
    # a link so fast that the stream's opening always costs more than it hides: auto never streams
    assert cm.layerwise_threshold(M, HW, cm.Link("ideal", "ideal", 1e18)) is None
    n = cm.layerwise_threshold(M, HW, link)
    assert n is not None  # the stream's fixed costs are paid back from n tokens on, not before
    per_token, kvb, g = cm.prefill(M, HW, 4096).time_s / 4096, cm.kv_bytes_per_token(M), groups_of(80, 1)
    assert layerwise_gain_s(n * kvb, n * per_token, g, cm.stream_link(link)) > 0
    assert layerwise_gain_s((n - 1) * kvb, (n - 1) * per_token, g, cm.stream_link(link)) <= 0


def test_a_cpu_prefill_slowed_by_its_own_transfer_can_make_streaming_lose():
    """On shared cores the prefill runs ~3% longer beside its transfer (CPU_OVERLAP_COST): a 1.7k-token
    SmolLM2 document (21.3 MB, 7.5 s of CPU prefill) gains at 0.1 Gbit/s, not at 1 Gbit/s, as measured."""
    from costmodel.article.layerwise import CPU_OVERLAP_COST  # noqa: PLC0415

    kv, prefill, groups = 21.35e6, 7.5, 30
    slow, fast = LinkSpec.gbits(0.1, 0.0033), LinkSpec.gbits(1.0, 0.0033)
    assert layerwise_gain_s(kv, prefill, groups, fast) > 0  # without the slowdown it would stream
    assert layerwise_gain_s(kv, prefill, groups, fast, overlap_cost=CPU_OVERLAP_COST) < 0
    assert layerwise_gain_s(kv, prefill, groups, slow, overlap_cost=CPU_OVERLAP_COST) > 1.0
