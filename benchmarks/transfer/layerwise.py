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

This module is the command (flags, the run, `--from-json`); `layerwise_shot.py` sends one request and
reads its figures, `layerwise_summary.py` predicts, summarizes and prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.transfer.layerwise_shot import Shot, derive, documents, send
from benchmarks.transfer.layerwise_summary import calibrated_link, predict, print_table, summarize
from cli.output import emit_json
from costmodel.article.layerwise import DEFAULT_GROUP_OVERHEAD_S, LinkSpec
from costmodel.provenance import OUT_DIR_HELP, write_result

MODES = ("bulk", "layerwise", "auto")


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
