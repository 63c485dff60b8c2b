"""`pdserve plan --reprice DIR`: every `--verify` result in a folder predicted again by the code as it
is now, and the planner's accuracy over all of them (the ledger).

One result re-priced (benchmarks/plan_reprice.py) shows how a change moves one run; a change to the
simulator or the step fit is judged here on every run kept, each result at its own flags and with
its own calibration, in seconds (297 measured rounds in ~40 s on the 2-core VM, 2026-12-07), and the
figure quoted with this command beside it.

The rows are split by the plan's own chance now that each candidate misses an SLO at its price error
(`miss_risk`, costmodel/plan/risk.py): off an SLO's edge (under 20% or over 90%, benchmarks/
verify_rows.py `EDGE`), on one, or not judged (outside the top candidates the plan prices an
interval for). On an edge a few percent on every step moves many requests across the SLO, and two
measurements of one deployment differ as much; off one the prediction should hold. For each class:
rounds within issue 42's per-candidate targets (goodput within 10%, attainment within 5 points),
plain (the calibration's prices) and at the timed pass's own step pace (`at_run`, after the fact);
a plain miss that its run's pace puts within both is the machine's pace between calibrating and
deploying, not the simulator. Two more columns say how far to trust that split: the rounds whose
own pace alone moves the plain prediction past the targets (the floor: no prediction made before
the run knows its pace), and the rounds whose measured goodput lies in the plan's interval (its
price error, one standard deviation, on every step: about two in three would if that error were
the whole story). Nothing here is measured anew.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.engine.cli import table
from benchmarks.plan_reprice import (
    WITHIN_GOODPUT,
    WITHIN_POINTS,
    Repriced,
    attainment_points,
    goodput_error,
    log,
    reprice_file,
)
from benchmarks.verify_rows import EDGE
from cli import CliError
from cli.output import emit_json
from costmodel.plan.score import Judged

CLASSES = ("off_edge", "on_edge", "not_judged")


@dataclass(frozen=True)
class ResultRows:
    """One result file's rounds, predicted again (or why it could not be)."""

    path: Path
    date_utc: str | None
    device: str | None
    rows: tuple[Repriced, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"result": str(self.path), "date_utc": self.date_utc, "device": self.device}
        if self.error:
            return {**out, "error": self.error}
        return {**out, "rounds": [r.to_dict() for r in self.rows]}


def verified_results(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The `--verify` results in `folder` (JSON files with verified rows), oldest first, each read once."""
    found: list[tuple[str, Path, dict[str, Any]]] = []
    for p in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and (doc.get("verification") or {}).get("rows"):
            found.append((str((doc.get("provenance") or {}).get("date_utc") or ""), p, doc))
    return [(p, doc) for _, p, doc in sorted(found, key=lambda x: (x[0], x[1]))]


def reprice_all(results: list[tuple[Path, dict[str, Any]]], defaults: argparse.Namespace) -> list[ResultRows]:
    """Each result's rounds predicted again at its own flags; a result that cannot be (its
    calibration gone, a flag this code no longer has) is kept with its error, not dropped."""
    out = []
    for i, (p, doc) in enumerate(results, start=1):
        prov = doc.get("provenance") or {}
        device = (prov.get("device") or {}).get("name") if isinstance(prov.get("device"), dict) else None
        log(f"[{i}/{len(results)}] {p.name}")
        try:
            _, _, rows = reprice_file(p, defaults, result=doc)
            out.append(ResultRows(p, prov.get("date_utc"), device, tuple(rows)))
        except (CliError, ValueError, KeyError, TypeError) as e:
            out.append(ResultRows(p, prov.get("date_utc"), device, error=f"{type(e).__name__}: {e}"))
    return out


def edge_class(r: Repriced) -> str:
    if r.miss_risk is None:
        return "not_judged"
    return "on_edge" if EDGE[0] <= r.miss_risk <= EDGE[1] else "off_edge"


def within(p: Judged | None, m: Judged) -> tuple[bool, bool] | None:
    """(goodput within 10%, attainment within 5 points); None where nothing was measured good."""
    e = goodput_error(p, m)
    if e is None:
        return None
    pts = attainment_points(p, m) or 0.0
    return abs(e) <= WITHIN_GOODPUT, pts <= WITHIN_POINTS


def ledger(results: list[ResultRows]) -> dict[str, Any]:
    """Per edge class (and all together): rounds, how many within the targets plain and at their
    run's pace, the median plain goodput error, and the plain misses the run's pace explains."""
    rows = [r for res in results for r in res.rows]
    out: dict[str, Any] = {}
    for name in (*CLASSES, "all"):
        sel = [r for r in rows if name == "all" or edge_class(r) == name]
        plain = [(r, w) for r in sel if (w := within(r.plain, r.measured))]
        errs = [abs(e) for r, _ in plain if (e := goodput_error(r.plain, r.measured)) is not None]
        with_run = [(w, wr) for r, w in plain if (wr := within(r.at_run, r.measured))]
        # the floor under the targets: rounds whose own run's step pace alone moves the prediction
        # past them (plain against the same simulator at that pace), which no prediction made
        # before the run could know
        paced = [p for r, _ in plain if r.at_run and (p := within(r.plain, r.at_run))]
        misses = [wr for w, wr in with_run if not all(w)]
        ranged = [inside for r, _ in plain if (inside := r.inside_interval()) is not None]
        out[name] = {
            "rounds": len(plain),
            "goodput_within_10pct": sum(w[0] for _, w in plain),
            "attainment_within_5pts": sum(w[1] for _, w in plain),
            "both": sum(all(w) for _, w in plain),
            "goodput_error_median_abs": statistics.median(errs) if errs else None,
            "rounds_with_run_pace": len(with_run),
            "both_at_run_pace": sum(all(wr) for _, wr in with_run),
            "plain_misses_with_run_pace": len(misses),
            "plain_misses_within_at_run_pace": sum(all(wr) for wr in misses),
            "pace_alone_past_targets": sum(not all(p) for p in paced),
            "pace_alone_rounds": len(paced),
            "rounds_with_interval": len(ranged),
            "goodput_inside_interval": sum(ranged),
        }
    return out


def format_ledger(results: list[ResultRows], totals: dict[str, Any]) -> str:
    head = ["rows", "rounds", "goodput <=10%", "attain. <=5 pts", "both", "median |err|", "both at run pace"]
    head += ["misses the pace explains", "pace alone past them", "goodput in the plan's interval"]
    body = []
    for name in (*CLASSES, "all"):
        t = totals[name]
        med = t["goodput_error_median_abs"]
        body.append([
            name.replace("_", " "), str(t["rounds"]), str(t["goodput_within_10pct"]), str(t["attainment_within_5pts"]),
            str(t["both"]), "-" if med is None else f"{med:.1%}",
            f"{t['both_at_run_pace']} of {t['rounds_with_run_pace']}",
            f"{t['plain_misses_within_at_run_pace']} of {t['plain_misses_with_run_pace']}",
            f"{t['pace_alone_past_targets']} of {t['pace_alone_rounds']}",
            f"{t['goodput_inside_interval']} of {t['rounds_with_interval']}",
        ])  # fmt: skip
    failed = [r for r in results if r.error]
    lines = [
        f"{len(results) - len(failed)} verification results re-priced by the code as it is now "
        f"(nothing measured anew); rows by the plan's miss risk now "
        f"(off an edge: under {EDGE[0]:.0%} or over {EDGE[1]:.0%})",
        table(head, body),
    ]
    lines += [f"left out: {r.path.name}: {r.error}" for r in failed]
    return "\n".join(lines)


def main(args: argparse.Namespace, defaults: argparse.Namespace) -> int:
    folder = Path(args.reprice)
    slos = (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_stall_ms)
    if args.calibration or any(v is not None for v in slos):
        raise CliError(f"--reprice {folder}: a folder re-prices each result at its own calibration and SLOs; "
                       "give --calibration or SLOs with one result")  # fmt: skip
    found = verified_results(folder)
    if not found:
        raise CliError(f"--reprice {folder}: no `pdserve plan --verify` results in this folder")
    results = reprice_all(found, defaults)
    totals = ledger(results)
    if args.json:
        emit_json({"folder": str(folder), "edge": list(EDGE), "ledger": totals,
                   "results": [r.to_dict() for r in results]})  # fmt: skip
    else:
        print(format_ledger(results, totals))
    return 0
