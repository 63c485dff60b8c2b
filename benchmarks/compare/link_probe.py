"""The link probe of `pdserve bench compare --link-gbps G`: what one document costs on that link.

After a mode's timed run, each document of the workload is sent again, alone (nothing else in
flight), streamed: the client times its first and second token, and the request's timeline
(GET /v1/requests/{id}/timeline) gives the KV pull (bytes, ms, measured Gbit/s) and the decode
admission wait. Beside each figure: the simulator's prediction for the same request on a link of
G Gbit/s (labelled simulated); the timeline also gives the nominal pull time bytes / G.

The figure the article turns on: the transfer's share of time-to-second-token. TTFT never waits
for the KV (the prefill worker samples the first token); the second token does.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from costmodel.workloads import RequestSpec


def probe_documents(base_url: str, model: str, specs: list[RequestSpec], timeout_s: float = 300.0) -> list[dict]:
    """Each document alone, streamed: client TTFT/TTST and the server's timeline. `base_url` is
    the server root (no /v1)."""
    import httpx  # noqa: PLC0415 - only this pass talks HTTP directly (it needs the timeline by id)

    out = []
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        for s in (s for s in specs if s.kind == "document"):
            prompt = list(s.prompt) if isinstance(s.prompt, tuple) else s.prompt
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max(2, s.max_tokens),
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            rid, times, t0 = None, [], time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        times.append(time.perf_counter() - t0)
                        rid = rid or chunk.get("id")
            tl = client.get(f"/v1/requests/{rid}/timeline").json() if rid else {}
            t = tl.get("transfer") or {}
            out.append(
                {
                    "request_id": s.request_id,
                    "prompt_len": s.prompt_len,
                    "ttft_ms": times[0] * 1e3 if times else None,
                    "ttst_ms": times[1] * 1e3 if len(times) > 1 else None,
                    "prefill_ms": tl.get("prefill_ms"),
                    "decode_wait_ms": tl.get("decode_wait_ms"),
                    "transfer_ms": t.get("ms"),
                    "transfer_bytes": t.get("bytes"),
                    "transfer_gbits_per_s": t.get("gbits_per_s"),
                    "link_nominal_ms": t.get("link_nominal_ms"),
                    # prefix-cache hits shrink what is prefilled and pulled (the simulator has no cache)
                    "prefill_cached_tokens": tl.get("prefill_cached_tokens"),
                    "decode_cached_tokens": tl.get("decode_cached_tokens"),
                }
            )
    return out


def predict_documents(
    setup: Any, sim_cfg: Any, specs: list[RequestSpec], link_gbps: float, measured: list[dict]
) -> list[dict]:
    """The simulator's figures for each probed document alone on the link (simulated): TTFT, time
    to second token, and when disaggregated the KV transfer (the cost model's bytes for the whole
    prompt at G Gbit/s) and the decode admission wait (prefill end to the decode batch's next
    step, less the transfer: the link's queue and the step in flight)."""
    from costmodel.article import cost_model as cm  # noqa: PLC0415
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415 - the simulator, only when predicting

    by_id = {s.request_id: s for s in specs}
    out = []
    for m in measured:
        s = replace(by_id[m["request_id"]], arrival_s=0.0, max_tokens=max(2, by_id[m["request_id"]].max_tokens))
        r = cp.simulate_requests(sim_cfg, setup.steps, [s])[0]
        t = r.token_times
        xfer, admitted = (r.transfer_s, r.admitted) if t else (None, None)
        pulled = xfer is not None and admitted is not None
        out.append(
            {
                "request_id": s.request_id,
                "ttft_ms": t[0] * 1e3 if t else None,
                "ttst_ms": t[1] * 1e3 if len(t) > 1 else None,
                "transfer_ms": xfer * 1e3 if xfer is not None and pulled else None,
                "transfer_bytes": s.prompt_len * cm.kv_bytes_per_token(setup.steps.model, setup.steps.kv_dtype)
                if pulled
                else None,
                "decode_wait_ms": max(0.0, round((admitted - t[0] - xfer) * 1e3, 6))
                if xfer is not None and admitted is not None
                else None,
            }
        )
    return out


SIMULATED = ("ttft_ms", "ttst_ms", "decode_wait_ms", "transfer_ms")  # the figures the simulator predicts


def summary(measured: list[dict], predicted: list[dict] | None) -> dict[str, Any]:
    """Means over the probed documents, measured beside simulated, and the transfer share of TTST."""

    def mean(rows: list[dict], key: str) -> float | None:
        xs = [r[key] for r in rows if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    out: dict[str, Any] = {}
    for key in ("ttft_ms", "ttst_ms", "decode_wait_ms", "transfer_ms", "transfer_gbits_per_s", "prefill_ms"):
        out[key] = {
            "measured": mean(measured, key),
            "simulated": mean(predicted, key) if predicted and key in SIMULATED else None,
        }
    tx, ttst = out["transfer_ms"]["measured"], out["ttst_ms"]["measured"]
    out["transfer_share_of_ttst"] = {
        "measured": tx / ttst if tx is not None and ttst else None,
        "simulated": (out["transfer_ms"]["simulated"] / out["ttst_ms"]["simulated"])
        if out["transfer_ms"]["simulated"] and out["ttst_ms"]["simulated"]
        else None,
    }
    return out


def format_rows(label: str, link_gbps: float, s: dict[str, Any], stall: tuple[float | None, float | None]) -> str:
    def f(x: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if x is None else fmt.format(x)

    cells = [f"{label} @ {link_gbps:g} Gbit/s"]
    for key in ("ttft_ms", "ttst_ms", "decode_wait_ms", "transfer_ms"):
        cells.append(f"{f(s[key]['measured'])} ({f(s[key]['simulated'])})")
    cells.append(f"{f(stall[0])} ({f(stall[1])})")
    sh = s["transfer_share_of_ttst"]
    cells.append(f"{f(sh['measured'], '{:.0%}')} ({f(sh['simulated'], '{:.0%}')})")
    cells.append(f(s["transfer_gbits_per_s"]["measured"], "{:.2f}"))
    return " | ".join(cells)


HEADER = (
    "mode @ link | TTFT ms | time to 2nd token ms | decode wait ms | transfer ms | max stall ms | "
    "transfer share of TTST | pull Gbit/s   [measured (simulated)]"
)


def cluster_kwargs(args: Any) -> dict[str, Any]:
    """ServeConfig settings from bench compare's cluster flags (JSON resources parsed here)."""
    from cli import CliError  # noqa: PLC0415 - a bad flag is a one-line error

    out: dict[str, Any] = {}
    if args.ray_address:
        out["ray_address"] = args.ray_address
    if args.link_gbps is not None:
        if args.link_gbps <= 0:
            raise CliError(f"--link-gbps {args.link_gbps:g}: must be > 0")
        out["link_gbps"] = args.link_gbps
    for key in ("prefill_resources", "decode_resources"):
        text = getattr(args, key)
        if text:
            try:
                out[key] = json.loads(text)
            except ValueError as e:
                raise CliError(f"--{key.replace('_', '-')} {text!r}: not valid JSON ({e})") from None
    return out


def rehearsal_link(gbps: float) -> Any:
    """The cost model's Link for a G Gbit/s network link (bytes/s = G * 1e9 / 8)."""
    from costmodel.article import cost_model as cm  # noqa: PLC0415

    return cm.Link(f"link-{gbps:g}gbit", f"{gbps:g} Gbit/s network link (tc tbf)", gbps * 1e9 / 8)


def max_stall(mode: dict[str, Any]) -> tuple[float | None, float | None]:
    """(measured, simulated) longest stall of in-flight streams in a mode's timed run."""
    measured = ((mode.get("metrics") or {}).get("stall_ms") or {}).get("max")
    simulated = (mode.get("predicted") or {}).get("compared", {}).get("stall_max_ms", {}).get("predicted")
    return measured, simulated


def format_table(result: dict[str, Any]) -> str | None:
    """The link-probe rows of a bench compare result (None without --link-gbps)."""
    rows = []
    for m in result.get("modes", []):
        lp = m.get("link_probe")
        if not lp:
            continue
        rows.append(format_rows(m["label"], lp["link_gbps"], lp["summary"], max_stall(m)))
    return "\n".join([HEADER, *rows]) if rows else None
