"""What `bench soak` reads of a server's memory: each worker's RSS and C heap from /metrics, and a
series' growth after the warm-up."""

from __future__ import annotations

import re
import statistics

import httpx

MEMORY_GAUGES = ("rss", "heap_in_use", "heap_free")  # pdserve_worker_<name>_bytes


def worker_memory(url: str) -> dict[str, tuple[str, dict[str, float]]]:
    """worker -> (role, {gauge: MB}) from the server's /metrics ({} if it does not answer)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, tuple[str, dict[str, float]]] = {}
    for gauge in MEMORY_GAUGES:
        for m in re.finditer(rf"^pdserve_worker_{gauge}_bytes\{{([^}}]*)\}} (\S+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out.setdefault(labels["worker"], (labels.get("role", "?"), {}))[1][gauge] = float(m.group(2)) / 1024**2
    return out


def rss_growth(samples: list[tuple[float, float]], warm_s: float, end_s: float, slack_s: float) -> dict | None:
    """Growth of one RSS series after warm-up: None if it does not span the window [warm_s, end_s]
    within `slack_s` (a replacement worker started after the warm-up, or a worker killed before the end)."""
    window = [(t, m) for t, m in samples if t >= warm_s]
    if len(window) < 2 or window[0][0] > warm_s + slack_s or window[-1][0] < end_s - slack_s:
        return None
    first, last, peak = window[0][1], window[-1][1], max(m for _, m in window)
    # a single sample can catch a long prompt's activations live (+60-110 MB on a tiny prefill
    # worker): the trend is read from the medians of the window's first and last MEDIAN_S
    head = statistics.median(m for t, m in window if t <= window[0][0] + MEDIAN_S)
    tail = statistics.median(m for t, m in window if t >= window[-1][0] - MEDIAN_S)
    return {
        "from_mb": first,
        "to_mb": last,
        "max_mb": peak,
        "growth_pct": round((last / first - 1) * 100, 2),
        "max_growth_pct": round((peak / first - 1) * 100, 2),
        "median_from_mb": head,
        "median_to_mb": tail,
        "median_growth_pct": round((tail / head - 1) * 100, 2),
        "window_s": [window[0][0], window[-1][0]],
    }


MEDIAN_S = 120.0
