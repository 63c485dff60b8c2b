"""`pdserve bench layerwise`: what layer-wise KV streaming takes off the critical path, A/B on one server.

Sends documents of `--doc-words` words (slices of the article) one at a time to a disaggregated
pdserve server, each document twice in a row, once pulled whole after its prefill (`bulk`) and
once streamed group by group while it prefills (`layerwise`), alternating which goes first; the
request body's `kv_transfer` field picks the mode, so both run on the same workers in one run.
The server should run with `--no-prefix-cache` (the second copy would otherwise hit the caches).

Per request, from the client's stream and the server's timeline:
- TTFT, and the gap between the first and second token;
- exposed transfer = that gap minus one decode step (the median gap between later tokens): what
  of the KV hand-off the user waits for (transfer, plus the hand-off's own costs);
- the timeline's own `transfer.exposed_ms` (end of the last pull minus the end of the prefill);
- the cost model's prediction of the exposed transfer (costmodel/article/layerwise.py), with the link
  calibrated on the last warm-up document (its bulk pull's rate, its layer-wise pulls' per-pull
  cost; never on a measured document), from the request's measured prefill time, tail after the
  last layer and KV bytes, labelled predicted.

On the cluster rehearsal (docs/cluster.md), e.g. at 1 Gbit/s:

    pdserve cluster up --nodes 3 --link-gbps 1
    pdserve cluster exec 0 -- pdserve serve --ray-address 198.18.K.1:6379 --host 198.18.K.1 \\
        --prefill-resources '{"node1": 1}' --decode-resources '{"node2": 1}' --link-gbps 1 --no-prefix-cache
    pdserve bench layerwise --base-url http://198.18.K.1:8000 --link-gbps 1

`benchmarks/layerwise_cluster.sh` runs that at 0.1, 1 and 10 Gbit/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cli.output import emit_json
from costmodel.article.layerwise import DEFAULT_GROUP_OVERHEAD_S, LinkSpec, bulk_exposed_s, layerwise_exposed_s
from costmodel.provenance import OUT_DIR_HELP, write_result

ARTICLE = Path(__file__).resolve().parents[1] / "data" / "article.md"
MODES = ("bulk", "layerwise", "auto")
EXPOSED_FLOOR_MS = 1.0  # below this an exposed transfer is timing noise (client and server clocks)


@dataclass
class Shot:
    """One request: a document in one mode."""

    doc: int
    mode: str  # what the request asked for
    used: str = ""  # what the server did (under auto: bulk or layerwise)
    ttft_ms: float = 0.0
    gap12_ms: float = 0.0  # first to second token, at the client
    step_ms: float = 0.0  # median gap between later tokens (client)
    first_step_ms: float | None = None  # the request's first decode step (server: admission -> its token)
    exposed_ms: float = 0.0  # gap12 - the first decode step (gap12 - step_ms without a timeline)
    exposed_vs_later_steps_ms: float = 0.0  # gap12 - step_ms
    prompt_tokens: int = 0
    prefill_ms: float = 0.0  # on the prefill worker
    kv_bytes: int = 0
    groups: int = 0
    transfer_ms: float = 0.0  # the pulls' own time (layer-wise: their sum)
    timeline_exposed_ms: float | None = None  # last pull's end - prefill end
    overlap_ms: float | None = None
    decode_wait_ms: float | None = None
    handoff_ms: float | None = None  # on the servers: prefill end -> decode admission (transfer and waits)
    tail_ms: float | None = None  # layer-wise: prefill end - the last group's announcement
    open_ms: float | None = None  # layer-wise: the router's open_stream call
    predicted_exposed_ms: float | None = None  # filled in after the run
    token_ids: list[int] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)  # the server's, as it sent it
    error: str | None = None


def documents(n: int, words: int) -> list[str]:
    """`n` distinct documents of `words` words each: consecutive slices of the article."""
    text = ARTICLE.read_text().split()
    return [" ".join((text * (1 + (i + 1) * words // len(text)))[i * words : (i + 1) * words]) for i in range(n)]


async def send(client: Any, model: str, doc_index: int, text: str, mode: str, output_len: int) -> Shot:
    shot = Shot(doc_index, mode)
    times: list[float] = []
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=f"Summarize this document.\n\n{text}\n\nSummary:",
            max_tokens=output_len,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "kv_transfer": mode},
        )
        timeline: dict[str, Any] = {}
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
            extra = chunk.model_extra or {}
            if extra.get("pdserve"):
                timeline = extra["pdserve"].get("timeline") or timeline
    except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
        shot.error = f"{type(e).__name__}: {e}"
        return shot
    if len(times) < 3 or not timeline:
        shot.error = f"only {len(times)} tokens streamed" if timeline else "no timeline in the response"
        return shot
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    shot.ttft_ms = (times[0] - t0) * 1e3
    shot.gap12_ms = gaps[0]
    shot.step_ms = statistics.median(gaps[1:])
    shot.timeline = timeline
    derive(shot)
    tr = timeline.get("transfer") or {}
    shot.prompt_tokens = int(timeline.get("prompt_tokens", 0))
    shot.prefill_ms = float(timeline.get("prefill_ms") or 0.0)
    shot.kv_bytes = int(tr.get("bytes", 0))
    shot.groups = int(tr.get("groups", 0))
    shot.used = str(tr.get("mode", ""))
    shot.transfer_ms = float(tr.get("ms", 0.0))
    shot.timeline_exposed_ms = tr.get("exposed_ms")
    shot.overlap_ms = tr.get("overlap_ms")
    shot.decode_wait_ms = timeline.get("decode_wait_ms")
    shot.open_ms = timeline.get("kv_stream_open_ms")
    announced = timeline.get("prefill_groups") or []
    if announced and timeline.get("prefill_end_ms") is not None:
        shot.tail_ms = float(timeline["prefill_end_ms"]) - float(announced[-1][2])
    shot.token_ids = list(timeline.get("token_ids", []))
    if mode != "auto" and tr.get("mode") != mode:
        shot.error = f"asked for {mode}, the server used {tr.get('mode') or timeline.get('kv_transfer')}"
    return shot


def derive(shot: Shot) -> None:
    """The exposed transfer from the client's first gap and the server's stamps. The gap holds the
    hand-off and the request's first decode step; that step is taken off as the decode worker
    timed it (its admission to its token), not as the median later step: a freshly admitted
    sequence's first step ran 20-45 ms longer than its later ones, bulk or layer-wise alike."""
    tl = shot.timeline
    shot.exposed_vs_later_steps_ms = shot.gap12_ms - shot.step_ms
    shot.exposed_ms = shot.exposed_vs_later_steps_ms
    admitted, end, token_ms = tl.get("decode_admitted_ms"), tl.get("prefill_end_ms"), tl.get("token_ms") or []
    if admitted is not None and end is not None:
        shot.handoff_ms = float(admitted) - float(end)
    if admitted is not None and len(token_ms) > 1:
        shot.first_step_ms = float(token_ms[1]) - float(admitted)
        shot.exposed_ms = shot.gap12_ms - shot.first_step_ms


def predict(shots: list[Shot], link: LinkSpec, bulk_start_s: float = 0.0) -> None:
    """Each shot's exposed transfer by the cost model, from its own measured prefill and bytes.
    `bulk_start_s`: a bulk pull starts that long after the prefill's end (the first token's trip
    through the router and the decode worker's admission call; a layer-wise pull has none)."""
    for s in shots:
        if s.error is not None:
            continue
        if s.used == "bulk":
            s.predicted_exposed_ms = (bulk_start_s + bulk_exposed_s(s.kv_bytes, link)) * 1e3
        else:
            groups, tail = max(1, s.groups), (s.tail_ms or 0.0) / 1e3
            exposed = layerwise_exposed_s(s.kv_bytes, s.prefill_ms / 1e3, groups, link, tail_s=tail)
            s.predicted_exposed_ms = exposed * 1e3


def calibrated_link(warm: list[Shot], default_per_pull_s: float, burst: float) -> tuple[LinkSpec, float, str] | None:
    """The link as the last warm-up document measured it (never a measured document: the
    predictions are not replayed): its bulk pull's rate, and the per-pull cost its layer-wise
    pulls took beyond that pull's time (the default when it was not streamed). The first document
    is no calibration: its pull opens the UCX connection (seconds over TCP)."""
    last = max((s.doc for s in warm), default=-1)
    bulk = next((s for s in warm if s.doc == last and s.used == "bulk" and not s.error and s.transfer_ms > 0), None)
    if bulk is None:
        return None
    rate = max(1.0, bulk.kv_bytes - burst) / (bulk.transfer_ms / 1e3)  # the burst went at line rate
    lw = next((s for s in warm if s.doc == last and s.used == "layerwise" and not s.error and s.groups > 1), None)
    per_pull = default_per_pull_s
    if lw is not None and lw.transfer_ms > bulk.transfer_ms:
        per_pull = (lw.transfer_ms - bulk.transfer_ms) / 1e3 / (lw.groups - 1)
    tr, end = bulk.timeline.get("transfer") or {}, bulk.timeline.get("prefill_end_ms")
    start = max(0.0, (tr["start_ms"] - end) / 1e3) if tr.get("start_ms") is not None and end is not None else 0.0
    note = (
        f"{rate * 8 / 1e9:.2f} Gbit/s, {per_pull * 1e3:.2f} ms a pull, a bulk pull starting {start * 1e3:.1f} ms "
        f"after the prefill: calibrated on warm-up document {last + 1}"
    )
    return LinkSpec(rate, per_pull, burst), start, note


def _pairs(shots: list[Shot], other: str) -> list[tuple[Shot, Shot]]:
    """(bulk, other) shots of the same document, both without error."""
    by: dict[int, dict[str, Shot]] = {}
    for s in shots:
        if s.error is None:
            by.setdefault(s.doc, {})[s.mode] = s
    return [(d["bulk"], d[other]) for d in by.values() if "bulk" in d and other in d]


def summarize(shots: list[Shot], modes: tuple[str, str]) -> dict[str, Any]:
    """Medians per mode and the ratios of the second mode to bulk (all from this one run)."""
    out: dict[str, Any] = {}
    for mode in modes:
        ok = [s for s in shots if s.mode == mode and s.error is None]
        if not ok:
            continue

        def med(key: str, rows: list[Shot] = ok) -> float | None:
            vals = [getattr(s, key) for s in rows if getattr(s, key) is not None]
            return round(statistics.median(vals), 3) if vals else None

        out[mode] = {
            k: med(k)
            for k in (
                "ttft_ms",
                "gap12_ms",
                "step_ms",
                "exposed_ms",
                "exposed_vs_later_steps_ms",
                "first_step_ms",
                "handoff_ms",
                "timeline_exposed_ms",
                "predicted_exposed_ms",
                "overlap_ms",
                "transfer_ms",
                "prefill_ms",
                "kv_bytes",
                "prompt_tokens",
                "groups",
                "tail_ms",
                "open_ms",
            )
        }
        out[mode]["requests"] = len(ok)
    other = modes[1]
    if "bulk" in out and other in out:
        b, lw = out["bulk"], out[other]
        # a hidden transfer's exposed part is ~0 (either sign: two clocks); the ratio takes 1 ms for less
        out["exposed_floor_ms"] = EXPOSED_FLOOR_MS
        out[f"exposed_bulk_over_{other}"] = round(b["exposed_ms"] / max(lw["exposed_ms"], EXPOSED_FLOOR_MS), 2)
        if b["handoff_ms"] and lw["handoff_ms"] and lw["handoff_ms"] > 0:
            out[f"handoff_bulk_over_{other}"] = round(b["handoff_ms"] / lw["handoff_ms"], 2)
        out[f"ttft_{other}_over_bulk"] = round(lw["ttft_ms"] / b["ttft_ms"], 3)
        out[f"second_token_{other}_over_bulk"] = round(
            (lw["ttft_ms"] + lw["gap12_ms"]) / (b["ttft_ms"] + b["gap12_ms"]), 3
        )
        # the same document in both modes, a minute apart: prefill times drift by 10-20% across
        # documents and minutes on a shared VM, less within a pair
        pairs = _pairs(shots, other)
        if pairs:
            out[f"ttft_{other}_over_bulk_paired"] = round(statistics.median(o.ttft_ms / b.ttft_ms for b, o in pairs), 3)
            out[f"second_token_{other}_over_bulk_paired"] = round(
                statistics.median((o.ttft_ms + o.gap12_ms) / (b.ttft_ms + b.gap12_ms) for b, o in pairs), 3
            )
        # the fixed cost of one layer-wise pull: what the groups' pulls took beyond one bulk pull
        # of the same bytes, per pull (the cost model's per-group overhead)
        if lw["groups"] and lw["groups"] > 1 and lw["transfer_ms"] and b["transfer_ms"]:
            out["per_pull_overhead_ms"] = round((lw["transfer_ms"] - b["transfer_ms"]) / (lw["groups"] - 1), 3)
        for mode in modes:
            m = out[mode]
            if m["predicted_exposed_ms"] and m["exposed_ms"]:
                m["prediction_error"] = round(m["predicted_exposed_ms"] / m["exposed_ms"] - 1, 3)
            if m["predicted_exposed_ms"] and m["timeline_exposed_ms"]:
                m["prediction_error_vs_timeline"] = round(m["predicted_exposed_ms"] / m["timeline_exposed_ms"] - 1, 3)
            if m["predicted_exposed_ms"] is not None and m["timeline_exposed_ms"] is not None:
                # near 0 ms (a hidden transfer) a ratio means nothing: the difference does
                m["prediction_minus_timeline_ms"] = round(m["predicted_exposed_ms"] - m["timeline_exposed_ms"], 3)
        same = [
            a.token_ids == b2.token_ids
            for a in shots
            for b2 in shots
            if a.doc == b2.doc and a.mode == "bulk" and b2.mode == other and not a.error and not b2.error
        ]
        out["greedy_tokens_equal"] = bool(same) and all(same)
    return out


def print_table(shots: list[Shot], summary: dict[str, Any], link_note: str, modes: tuple[str, str]) -> None:
    from benchmarks.engine.cli import table  # noqa: PLC0415 - torch, only to print

    rows = []
    for mode in modes:
        m = summary.get(mode)
        if not m:
            continue
        rows.append(
            [
                mode,
                str(m["requests"]),
                f"{m['ttft_ms']:.1f}",
                f"{m['gap12_ms']:.1f}",
                f"{m['step_ms']:.1f}",
                f"{m['exposed_ms']:.1f}",
                f"{m['handoff_ms']:.1f}" if m["handoff_ms"] is not None else "-",
                f"{m['timeline_exposed_ms']:.1f}" if m["timeline_exposed_ms"] is not None else "-",
                f"{m['predicted_exposed_ms']:.1f}" if m["predicted_exposed_ms"] is not None else "-",
                f"{m['overlap_ms']:.1f}" if m["overlap_ms"] is not None else "-",
                f"{m['kv_bytes'] / 1e6:.2f}",
            ]
        )
    heads = [
        "mode",
        "n",
        "TTFT",
        "1st->2nd",
        "step",
        "exposed",
        "hand-off",
        "tl exposed",
        "predicted",
        "overlap",
        "KV MB",
    ]
    print(table(heads, rows))
    print(
        f"median ms per request; exposed = 1st->2nd gap (client) - the request's first decode step (server); "
        f"step = median later gap (client); hand-off = prefill end -> decode "
        f"admission (servers); tl exposed = last pull end - prefill end (timeline); predicted = cost model "
        f"(costmodel/article/layerwise.py) at {link_note}"
    )
    other = modes[1]
    if f"ttft_{other}_over_bulk" in summary:
        ttft, ttft_paired = summary[f"ttft_{other}_over_bulk"], summary.get(f"ttft_{other}_over_bulk_paired")
        second = summary[f"second_token_{other}_over_bulk"]
        second_paired = summary.get(f"second_token_{other}_over_bulk_paired")
        print(
            f"exposed transfer bulk/{other}: {summary[f'exposed_bulk_over_{other}']}x; TTFT {other}/bulk: {ttft} "
            f"(paired by document: {ttft_paired}); second token {other}/bulk: {second} (paired: {second_paired}); "
            f"greedy tokens equal: {summary['greedy_tokens_equal']}"
        )
    errors = [s for s in shots if s.error]
    for s in errors[:5]:
        print(f"doc {s.doc} {s.mode}: {s.error}", file=sys.stderr)


async def run(args: argparse.Namespace) -> tuple[list[Shot], list[Shot]]:
    """(warm-up shots, measured shots)."""
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or "none", timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    docs = documents(args.warmup + args.docs, args.doc_words)
    shots: list[Shot] = []
    warm: list[Shot] = []
    for i, text in enumerate(docs):
        order = args.modes if i % 2 == 0 else args.modes[::-1]
        for mode in order:
            shot = await send(client, model, i, text, mode, args.output_len)
            (shots if i >= args.warmup else warm).append(shot)
            if not args.no_progress:
                what = "warm-up" if i < args.warmup else f"doc {i - args.warmup + 1}/{args.docs}"
                note = shot.error or f"TTFT {shot.ttft_ms:.0f} ms, exposed {shot.exposed_ms:.1f} ms"
                print(f"{what} {mode}: {note}", file=sys.stderr)
    return warm, shots


def resummarize(path: Path, modes: tuple[str, str], out: Path | None = None, as_json: bool = False) -> int:
    """A saved run summarized again (the derived figures; each request keeps its run's prediction), in place."""
    doc = json.loads(path.read_text())
    names = {f for f in Shot.__dataclass_fields__}
    shots = [Shot(**{k: v for k, v in r.items() if k in names}) for r in doc["requests"]]
    for shot in shots:
        if shot.error is None:
            derive(shot)
    old = doc["summary"]  # each request keeps the prediction its run made (at the full-precision link)
    summary = summarize(shots, modes)
    for key in ("link_for_predictions_gbps", "per_pull_s_for_predictions", "predictions_calibrated_on"):
        summary[key] = old[key]
    summary["bulk_start_s_for_predictions"] = old.get("bulk_start_s_for_predictions", 0.0)
    summary["resummarized"] = f"summary recomputed from the saved requests by {' '.join(sys.argv)}"
    doc.update(summary=summary, requests=[asdict(s) for s in shots])
    target = out or path
    target.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if as_json:
        emit_json({"summary": summary, "result_file": str(target)})
    else:
        print_table(shots, summary, old["predictions_calibrated_on"], modes)
        print(f"wrote {target}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument("--base-url", default=None, help="a disaggregated pdserve server, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="summarize a saved run again (this benchmark's JSON; rewritten in place, or to --out-dir) "
        "instead of sending anything",
    )
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--docs", type=int, default=6, help="documents measured, each in both modes (default 6)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="documents sent first and not measured (default 2: the first opens the connections, the last "
        "calibrates the predictions' link rate and per-pull cost)",
    )
    p.add_argument("--doc-words", type=int, default=1024, help="words per document (default 1024)")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument(
        "--modes",
        default="bulk,layerwise",
        help="the two kv_transfer modes compared, bulk first (default bulk,layerwise; bulk,auto checks the auto rule)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="the link's nominal rate (recorded; predictions use it with --predict-at-nominal)",
    )
    p.add_argument(
        "--link-burst-kib",
        type=float,
        default=0.0,
        help="a shaped link's token-bucket burst, in the predictions (the cluster rehearsal's `tc tbf`: "
        "max(256 KiB, 1 ms of traffic); benchmarks/layerwise_cluster.sh passes it); default 0",
    )
    p.add_argument(
        "--predict-at-nominal",
        action="store_true",
        help="predict at --link-gbps instead of the rate the last warm-up document measured",
    )
    p.add_argument(
        "--group-overhead-ms",
        type=float,
        default=DEFAULT_GROUP_OVERHEAD_S * 1e3,
        help="per-pull fixed cost in the predictions when the warm-up did not stream (default: "
        "costmodel.article.layerwise's measured figure)",
    )
    p.add_argument("--out", default=None, help="result name (default layerwise-<link>)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--json", action="store_true", help="print the result as one JSON document instead of the table")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    from cli import CliError  # noqa: PLC0415

    if args.docs < 1 or args.doc_words < 16 or args.output_len < 3:
        raise CliError("--docs must be >= 1, --doc-words >= 16 and --output-len >= 3")
    modes = tuple(m.strip() for m in args.modes.split(","))
    if len(modes) != 2 or modes[0] != "bulk" or modes[1] not in MODES[1:]:
        raise CliError(f"--modes: expected bulk,layerwise or bulk,auto, got {args.modes!r}")
    args.modes = modes
    if not args.from_json and not args.base_url:
        raise CliError("--base-url is required (or --from-json FILE)")
    if args.from_json:
        src = Path(args.from_json)
        if not src.is_file():
            raise CliError(f"--from-json {args.from_json!r}: no such file")
        out = Path(args.out_dir) / f"{args.out or src.stem}.json" if args.out_dir else None
        return resummarize(src, args.modes, out, args.json)
    warm, shots = asyncio.run(run(args))
    per_pull = args.group_overhead_ms / 1e3
    burst = args.link_burst_kib * 1024
    calibrated = calibrated_link(warm, per_pull, burst) if not args.predict_at_nominal else None
    bulk_start = 0.0
    if calibrated is not None:
        link, bulk_start, note = calibrated
    elif args.link_gbps:
        link = LinkSpec.gbits(args.link_gbps, per_pull, burst)
        note = f"{args.link_gbps:g} Gbit/s (--link-gbps, nominal)"
    else:
        raise CliError("no warm-up bulk pull to calibrate the link on: give --link-gbps or --warmup 2")
    predict(shots, link, bulk_start)
    summary = summarize(shots, args.modes)
    summary["link_for_predictions_gbps"] = round(link.bytes_per_s * 8 / 1e9, 4)
    summary["per_pull_s_for_predictions"] = link.per_pull_s
    summary["bulk_start_s_for_predictions"] = bulk_start
    summary["predictions_calibrated_on"] = note
    name = args.out or (f"layerwise-{args.link_gbps:g}g" if args.link_gbps else "layerwise")
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    path = write_result(
        name,
        {"summary": summary, "requests": [asdict(s) for s in shots]},
        config,
        Path(args.out_dir) if args.out_dir else None,
    )
    if args.json:
        emit_json({"summary": summary, "result_file": str(path)})
    else:
        print_table(shots, summary, note, args.modes)
        print(f"wrote {path}")
    return 0 if all(s.error is None for s in shots) else 1
