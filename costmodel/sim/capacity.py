"""The article's capacity table run through the simulator, beside its closed form
(`pdserve simulate --capacity`)."""

from __future__ import annotations

import bisect
from typing import Any

from costmodel.article import cost_model as cm
from costmodel.sim.engine import Request, SimConfig, StepModel, Workload, simulate
from costmodel.sim.summary import summarize


def capacity_special_case(
    steps: StepModel,
    rates: list[float],
    prompt: int = 4096,
    batch: int = 32,
    duration: float = 400.0,
    warmup: float = 20.0,
) -> list[dict[str, Any]]:
    """The article's capacity table, simulated: `batch` endless streams on one colocated node,
    documents of `prompt` tokens evenly spaced at each rate, every decode sequence at the fixed
    context of `steps` (the article's assumption). Sequences that fit = decode tok/s / per-seq speed."""
    step = steps.decode([Request(-1, "chat", 0, 1, 2)] * batch)
    closed = {
        r.prefills_per_s: r
        for r in cm.capacity_table(
            steps.model,
            steps.hw,
            rates,
            prompt,
            batch,
            steps.fixed_ctx or prompt,
            steps.mfu,
            steps.weight_dtype,
            steps.kv_dtype,
        )
    }
    rows = []
    for rate in rates:
        wl = Workload(
            streams=batch,
            chat_prompt=(1, 1),
            chat_output=(10**9, 10**9),
            doc_rate=rate,
            doc_prompt=(prompt, prompt),
            doc_output=(1, 1),
            duration=duration,
            arrivals="uniform",
        )
        # max_batch + 1: a document (one output token) must not wait for a batch slot it never uses
        sim = simulate(SimConfig(mode="colocated", max_batch=batch + 1), steps, wl, horizon=duration)
        decode_tokens = sum(
            bisect.bisect_left(r.token_times, duration) - bisect.bisect_left(r.token_times, warmup)
            for r in sim.requests
            if r.kind == "chat"
        )
        m = summarize(sim, warmup, {"ttft_ms": None, "tpot_ms": None, "itl_ms": None})
        c = closed[rate]
        rows.append(
            {
                "prefills_per_s": rate,
                "gpu_share": m["prefill_only_share"],
                "decode_sequences": decode_tokens / (duration - warmup) * step,  # tok/s over per-seq speed 1/step
                "closed_form_gpu_share": c.gpu_share,
                "closed_form_decode_sequences": c.decode_sequences,
            }
        )
    return rows
