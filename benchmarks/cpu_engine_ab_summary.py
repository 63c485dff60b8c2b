"""The summary of `benchmarks/cpu_engine_ab.sh`: one row per server run (the bench's throughput,
ITL and TTFT, the worker's own decode-step and prefill figures from its step log, its threads and
GEMM dtype, the time to ready), and per mode the ratios new/old from the runs of this one A/B.

    python -m benchmarks.cpu_engine_ab_summary RUNS_DIR OLD_TREE [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.engine.cli import table
from costmodel.provenance import write_result


def run_row(runs: Path, label: str) -> dict[str, Any] | None:
    """One server run's figures, or None if it left no result (a server that did not start)."""
    try:
        m = json.loads((runs / f"{label}.json").read_text())["metrics"]
    except (OSError, ValueError, KeyError):
        return None
    build, mode, rnd = label.split("-")
    row: dict[str, Any] = {
        "label": label,
        "build": build,
        "mode": mode,
        "round": int(rnd),
        "output_tok_s": m["output_throughput"],
        "itl_p50_ms": m["itl_ms"]["p50"],
        "itl_p90_ms": m["itl_ms"]["p90"],
        "ttft_p50_ms": m["ttft_ms"]["p50"],
        "completed": m["completed"],
        **json.loads((runs / f"{label}.start.json").read_text()),
    }
    steps = json.loads((runs / f"{label}.steps.json").read_text())["data"]
    for w in steps:
        s = w["steps"]
        decode8 = [x["seconds"] for x in s if x["prefill_tokens"] == 0 and x["decode_seqs"] == 8]
        pre = [x for x in s if x["prefill_tokens"] > 0]
        role = "prefill" if w["role"] == "prefill" else "decode"
        row[f"{role}_torch_threads"] = w.get("torch_threads")
        row[f"{role}_cpu_gemm"] = w.get("cpu_gemm") or ("fp32" if build == "old" else None)
        if decode8:
            row["decode8_step_p50_ms"] = statistics.median(decode8) * 1e3
        if pre and role == "prefill" or (pre and mode == "colocated"):
            # a colocated worker's prefill steps carry decode rows too: their time is the step's
            row["prefill_us_per_token"] = sum(x["seconds"] for x in pre) / sum(x["prefill_tokens"] for x in pre) * 1e6
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode and new build ("new", "newx"): the mean of its runs over the mean of the old
    ones, for each figure."""
    out: dict[str, dict[str, float]] = {}
    for mode in sorted({r["mode"] for r in rows}):
        for build in sorted({r["build"] for r in rows} - {"old"}):
            old = [r for r in rows if r["mode"] == mode and r["build"] == "old"]
            new = [r for r in rows if r["mode"] == mode and r["build"] == build]
            if not old or not new:
                continue
            out[mode if build == "new" else f"{mode} ({build})"] = {
                k: statistics.mean(r[k] for r in new) / statistics.mean(r[k] for r in old)
                for k in ("output_tok_s", "itl_p50_ms", "ttft_p50_ms", "decode8_step_p50_ms", "ready_s")
                if all(k in r for r in old + new)
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path)
    p.add_argument("old_tree", type=Path)
    p.add_argument("--out", type=Path, default=None, help="the summary file (default RUNS/../cpu-engine-ab.json)")
    a = p.parse_args(argv)
    labels = sorted(f.name[: -len(".start.json")] for f in a.runs.glob("*.start.json"))
    rows = [r for r in (run_row(a.runs, lb) for lb in labels) if r is not None]
    old_commit = subprocess.run(
        ["git", "-C", str(a.old_tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    out = a.out or a.runs.parent / "cpu-engine-ab.json"
    new_over_old = ratios(rows)
    payload = {"bench": "cpu-engine-ab", "old_commit": old_commit, "rows": rows, "new_over_old": new_over_old}
    path = write_result(out.stem, payload, out_dir=out.parent)
    cells = [
        [
            r["label"],
            f"{r['output_tok_s']:.1f}",
            f"{r['itl_p50_ms']:.0f}",
            f"{r['ttft_p50_ms']:.0f}",
            f"{r.get('decode8_step_p50_ms', float('nan')):.0f}",
            f"{r.get('prefill_us_per_token', float('nan')):.0f}",
            f"{r.get('decode_torch_threads') or '-'}",
            f"{r.get('decode_cpu_gemm') or '-'}",
            f"{r['ready_s']:.0f}",
            f"{r['load_at_start']:.2f}",
        ]
        for r in rows
    ]
    heads = ["run", "out tok/s", "ITL p50 ms", "TTFT p50 ms", "b8 step ms", "prefill us/tok"]
    print(table([*heads, "threads", "gemm", "ready s", "load"], cells))
    for mode, rs in new_over_old.items():
        print(f"{mode}: new/old " + ", ".join(f"{k} {v:.2f}x" for k, v in rs.items()))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
