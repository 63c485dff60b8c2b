"""The worker memory guard (issue 22): /metrics exports each worker's RSS, and the router warns
when a worker's RSS keeps growing after warm-up.

The watch's arithmetic is tested on hand-made WorkerStats; the rest through real parts: Ray
actors, uvicorn on 127.0.0.1, the health loop reading the workers' stats by itself.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from contracts.worker import WorkerStats
from router.workers.rss_watch import RssWatch
from tests.helpers import samples, wait_until

MB = 1024**2


def stats(name: str, rss_mb: float, steps: int) -> WorkerStats:
    return WorkerStats(name, "prefill", 0, 0, 0, 64, 64, steps=steps, rss_bytes=int(rss_mb * MB))


def test_watch_takes_its_baseline_after_warm_up_and_warns_at_each_multiple(caplog):
    w = RssWatch(bound_mb=100, warmup_steps=10)
    caplog.set_level(logging.WARNING, logger="pdserve.router")
    assert w.observe([stats("p0", 300, 0), stats("p0", 900, 9)]) == []  # warming up: any growth is fine
    assert w.baseline("p0") is None
    assert w.observe([stats("p0", 1000, 10)]) == [] and w.baseline("p0") == 1000 * MB
    assert w.observe([stats("p0", 1099, 50)]) == []  # below the bound
    (msg,) = w.observe([stats("p0", 1100, 60)])
    assert "p0" in msg and "grown 100 MB" in msg and "--rss-growth-warn-mb" in msg
    assert w.observe([stats("p0", 1150, 70), stats("p0", 1120, 80)]) == []  # same multiple: said once
    assert len(w.observe([stats("p0", 1310, 90)])) == 1  # the third multiple
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2
    # another worker (a replacement has a new name) has its own baseline; RSS 0 = not measurable
    assert w.observe([stats("p1", 2000, 10), stats("p2", 0, 99)]) == [] and w.baseline("p2") is None
    with pytest.raises(ValueError):
        RssWatch(bound_mb=0)


def test_memory_flags_reach_the_workers_and_are_checked():
    from router.config import ConfigError, ServeConfig  # noqa: PLC0415
    from router.launch import rss_watch  # noqa: PLC0415

    cfg = ServeConfig.build({"gemm_row_buckets": 0, "rss_growth_warn_mb": 64, "rss_warmup_steps": 5})
    assert cfg.worker_config().gemm_row_buckets == 0
    watch = rss_watch(cfg)
    assert watch is not None and (watch.bound_bytes, watch.warmup_steps) == (64 * MB, 5)
    assert rss_watch(ServeConfig(rss_growth_warn_mb=0)) is None
    assert ServeConfig().worker_config().gemm_row_buckets == 4  # the documented default
    for flag, bad in (("gemm_row_buckets", -1), ("rss_growth_warn_mb", -1.0), ("rss_warmup_steps", -1)):
        with pytest.raises(ConfigError, match=flag.replace("_", "-")):
            ServeConfig(model="tiny", **{flag: bad}).validate()


@pytest.fixture(scope="module")
def watched_server(ray_cluster):
    """A disaggregated tiny server whose watch warns at any growth (a 4 KB page), after no warm-up;
    the health loop reads the stats for it every half second (no scrape needed)."""
    pytest.importorskip("ray")
    import router.lifecycle.orchestrator as orchestrator  # noqa: PLC0415
    from router.config import ServeConfig  # noqa: PLC0415
    from router.serve_cli import ServerThread  # noqa: PLC0415

    saved, orchestrator.RSS_CHECK_S = orchestrator.RSS_CHECK_S, 0.5
    cfg = ServeConfig(
        model="tiny", mode="disagg", prefill=1, decode=1, num_blocks=128, rss_growth_warn_mb=0.004, rss_warmup_steps=0
    )
    try:
        with ServerThread(cfg, startup_timeout_s=180) as srv:
            yield srv
    finally:
        orchestrator.RSS_CHECK_S = saved


def test_metrics_export_each_workers_rss(watched_server):
    text = httpx.get(watched_server.url + "/metrics", timeout=30).text
    rss = samples(text, "pdserve_worker_rss_bytes")
    assert sorted(labels["role"] for labels, _ in rss) == ["decode", "prefill"], text
    assert all(50 * MB < v < 16 * 1024 * MB for _, v in rss), rss  # a real process's RSS
    assert not samples(text, "pdserve_worker_cuda_memory_reserved_bytes")  # CPU workers: no CUDA series
    # the C heap beside it (glibc): what malloc has handed out is part of the RSS, never all of it
    heap = {labels["worker"]: v for labels, v in samples(text, "pdserve_worker_heap_in_use_bytes")}
    free = samples(text, "pdserve_worker_heap_free_bytes")
    assert len(heap) == 2 and len(free) == 2, text
    assert all(MB < heap[labels["worker"]] < v for labels, v in rss), (heap, rss)


def test_health_loop_warns_when_a_workers_rss_grows(watched_server, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.router")
    sent = 0

    def warned() -> list[str]:
        nonlocal sent
        got = [r.getMessage() for r in caplog.records if "RSS" in r.getMessage()]
        if not got:  # prompts of new lengths grow the workers (new KV, new shapes); no /metrics scrape here
            body = {"model": "tiny", "prompt": "x" * (40 + 37 * sent), "max_tokens": 4, "temperature": 0}
            r = httpx.post(watched_server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            sent += 1
        return got

    warnings = wait_until(warned, 90, lambda: f"an RSS warning ({sent} requests sent)", interval=0.6)
    assert "since warm-up" in warnings[0] and "worker" in warnings[0]


def test_soak_reads_the_trend_from_medians_not_from_one_sample():
    """The soak's flatness figure: a last sample that caught a long prompt's activations reads as
    growth first to last, not by the medians of the window's ends."""
    from benchmarks.soak.memory import MEDIAN_S, rss_growth  # noqa: PLC0415

    flat = [(t, 500.0 + (60.0 if t == 1800 else 0.0)) for t in range(0, 1805, 5)]
    g = rss_growth(flat, 600, 1800, 15)
    assert g is not None and g["growth_pct"] == 12.0 and g["median_growth_pct"] == 0.0
    creeping = [(t, 500.0 + t / 60) for t in range(0, 1805, 5)]  # 1 MB a minute
    g = rss_growth(creeping, 600, 1800, 15)
    head, tail = 500 + (600 + MEDIAN_S / 2) / 60, 500 + (1800 - MEDIAN_S / 2) / 60  # 511 and 529 MB
    assert g is not None and g["median_growth_pct"] == pytest.approx((tail / head - 1) * 100, abs=0.01)
    assert rss_growth(creeping, 600, 2400, 15) is None  # a series that does not span the window
