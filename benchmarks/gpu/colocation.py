"""`bench gpu` green section: decode ITL while long prefills run on the same card (decode alone,
colocated on one stream, two streams time-sharing the card, green-context SM splits)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from benchmarks.gpu.timing import CTX, cuda_time, pct


# ---- single-GPU disaggregation: decode ITL under prefill pressure ----------------------------
def bench_green(
    runner, graphs, sm_list: list[int], cap_s: float, B: int = 32, P: int = 8192, mode_s: float = 6.0
) -> dict:
    from engine.gpu.green_contexts import SmPartition, green_contexts_supported  # noqa: PLC0415
    from engine.runner.model_runner import StepItem  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    per_seq = CTX // 16
    if B not in graphs.graphs or B * per_seq + P // 16 >= runner.cache_cfg.num_blocks - 1:
        return {"skipped": f"needs a batch-{B} graph and room for a {P}-token prefill in the pool"}
    tables = torch.arange(B * per_seq, device="cuda").view(B, per_seq)
    graphs.replay(torch.randint(0, 1000, (B,), device="cuda"), torch.full((B,), CTX - 1, device="cuda"), tables)
    item = StepItem(torch.randint(0, 1000, (P,)).tolist(), 0, list(range(B * per_seq, B * per_seq + P // 16)))
    ids, pos, meta = runner.step_inputs(None, [item])

    def prefill():
        runner.model(ids, pos, runner.backend, runner.cache, meta)

    def decode():
        graphs.graphs[B].replay()

    def measure(mode: str, part: SmPartition | None) -> dict:
        itl, done = [], [0]
        stop = threading.Event()
        t_end = time.perf_counter() + mode_s

        def prefill_loop(stream):
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    prefill()
                    stream.synchronize()
                    done[0] += 1

        th = None
        if part is not None:
            th = threading.Thread(target=prefill_loop, args=(part.prefill_stream,), daemon=True)
            th.start()
        stream = part.decode_stream if part is not None else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            last = time.perf_counter()
            while time.perf_counter() < t_end:
                if mode == "colocated":  # the article's freeze: the prefill runs instead of decode
                    prefill()
                    done[0] += 1
                decode()
                stream.synchronize()
                now = time.perf_counter()
                itl.append(now - last)
                last = now
        stop.set()
        if th is not None:
            th.join(60)
        ms = [x * 1e3 for x in itl[1:]]
        return {
            "mode": mode,
            "decode_sms": part.decode_sms if part and part.partitioned else None,
            "prefill_sms": part.prefill_sms if part and part.partitioned else None,
            "itl_p50_ms": pct(ms, 0.5),
            "itl_p90_ms": pct(ms, 0.9),
            "itl_p99_ms": pct(ms, 0.99),
            "decode_tokens_per_s": B * len(ms) / (sum(ms) / 1e3) if ms else None,
            "prefill_tokens_per_s": done[0] * P / mode_s,
            "steps": len(ms),
        }

    rows = [measure("decode_alone", None), measure("colocated", None), measure("two_streams", SmPartition.shared())]
    out: dict[str, Any] = {"batch": B, "context": CTX, "prefill_tokens": P, "rows": rows}
    if not green_contexts_supported():
        out["green"] = "not supported by this torch build or driver"
        return out
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    full = cuda_time(lambda: a @ a, reps=3)
    probe = []
    for d in sm_list:
        if time.perf_counter() + 2 * mode_s > end:
            break
        try:
            part = SmPartition.create(decode_sms=d)
            with torch.cuda.stream(part.prefill_stream):  # does the split bind? a GEMM slows ~ SM ratio
                slow_p = cuda_time(lambda: a @ a, reps=3) / full
            with torch.cuda.stream(part.decode_stream):
                probe.append(
                    {
                        "decode_sms": part.decode_sms,
                        "prefill_sms": part.prefill_sms,
                        "how": part.how,
                        "decode_gemm_slowdown": cuda_time(lambda: a @ a, reps=3) / full,
                        "prefill_gemm_slowdown": slow_p,
                    }
                )
                decode()  # graph replay on a green stream, checked before it is timed
            torch.cuda.synchronize()
            rows.append(measure("green", part))
        except Exception as e:  # noqa: BLE001 (report and go on: an API gap must not sink the run)
            out.setdefault("errors", []).append(f"green decode_sms={d}: {type(e).__name__}: {e}")
    out["sm_probe"] = probe
    return out
