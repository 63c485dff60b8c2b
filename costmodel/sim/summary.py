"""A simulated run summarized as `pdserve simulate` reports it: TTFT, TPOT, ITL and stall
percentiles, goodput under SLOs, throughput, and the prefill-only share of the front pool."""

from __future__ import annotations

import bisect
from typing import Any

from costmodel.sim.engine import Request, Sim


def percentiles(xs: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles (numpy's default), None when there is no sample."""
    if not xs:
        return {f"p{p}": None for p in ps}
    s = sorted(xs)
    out: dict[str, float | None] = {}
    for p in ps:
        k = (len(s) - 1) * p / 100
        i = int(k)
        out[f"p{p}"] = s[i] + (s[min(i + 1, len(s) - 1)] - s[i]) * (k - i)
    return out


def _doc_stalls(docs: list[Request], streams: list[Request]) -> list[float]:
    """Per document: the longest token gap of any stream in flight when it arrived, among the
    gaps that overlap [arrival, document's first token]."""
    out = []
    for d in docs:
        a, f = d.arrival, d.token_times[0]
        worst = 0.0
        for r in streams:
            t = r.token_times
            if r is d or len(t) < 2 or not t[0] <= a < t[-1]:
                continue
            i = max(bisect.bisect_right(t, a) - 1, 0)  # gap t[i] -> t[i+1] contains the arrival
            while i + 1 < len(t) and t[i] < f:
                worst = max(worst, t[i + 1] - t[i])
                i += 1
        out.append(worst)
    return out


def summarize(sim: Sim, warmup: float, slo: dict[str, float | None]) -> dict[str, Any]:
    end = sim.wl.duration
    window = end - warmup
    measured = [r for r in sim.requests if warmup <= r.arrival < end]
    done = [r for r in measured if r.done]
    ttft = {
        k: [(r.token_times[0] - r.arrival) * 1e3 for r in done if k in ("all", r.kind)] for k in ("all", "chat", "doc")
    }
    tpot = [
        (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) * 1e3 for r in done if len(r.token_times) > 1
    ]
    itl = [(b - a) * 1e3 for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    stalls = _doc_stalls([r for r in done if r.kind == "doc"], sim.requests)
    # disagg: what of each KV crossing was left after its prefill, and when documents' second
    # token came (the first one the crossing delays)
    exposed = [r.exposed_transfer_s * 1e3 for r in done if r.exposed_transfer_s is not None]
    ttst_doc = [(r.token_times[1] - r.arrival) * 1e3 for r in done if r.kind == "doc" and len(r.token_times) > 1]
    tokens = sum(
        bisect.bisect_left(r.token_times, end) - bisect.bisect_left(r.token_times, warmup) for r in sim.requests
    )

    def good(r: Request) -> bool:
        t = r.token_times
        gaps = [b - a for a, b in zip(t, t[1:])]
        return (
            (slo["ttft_ms"] is None or (t[0] - r.arrival) * 1e3 <= slo["ttft_ms"])
            and (slo["tpot_ms"] is None or len(t) < 2 or (t[-1] - t[0]) / (len(t) - 1) * 1e3 <= slo["tpot_ms"])
            and (slo["itl_ms"] is None or not gaps or max(gaps) * 1e3 <= slo["itl_ms"])
        )

    prefill_busy = sum(
        max(0.0, min(s.end, end) - max(s.start, warmup))
        for w in sim.front
        for s in w.log
        if s.prefill_tokens and not s.decode_tokens
    )
    return {
        "mode": sim.cfg.mode,
        "label": sim.cfg.label,
        "gpus": sim.cfg.gpus,
        "requests": len(sim.requests),
        "finished": len(sim.finished),
        "measured": len(measured),
        "lost": len(sim.requests) - len(sim.finished),
        "generated_tokens": sum(len(r.token_times) for r in sim.requests),
        "ttft_ms": percentiles(ttft["all"]),
        "ttft_chat_ms": percentiles(ttft["chat"]),
        "ttft_doc_ms": percentiles(ttft["doc"]),
        "ttst_doc_ms": percentiles(ttst_doc),
        "kv_transfer": sim.cfg.kv_transfer if sim.cfg.mode == "disagg" else None,
        "kv_stream_layers": sim.cfg.kv_stream_layers if sim.cfg.mode == "disagg" else None,
        "kv_exposed_ms": percentiles(exposed),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "max_stall_ms": max(stalls) * 1e3 if stalls else None,
        "mean_doc_stall_ms": sum(stalls) / len(stalls) * 1e3 if stalls else None,
        "documents": len(stalls),
        "throughput_tok_s": tokens / window,
        "throughput_tok_s_per_gpu": tokens / window / sim.cfg.gpus,
        "goodput_req_s": sum(good(r) for r in done) / window,
        "slo_attainment": sum(good(r) for r in done) / len(done) if done else None,
        "prefill_only_share": prefill_busy / (window * len(sim.front)),
    }
