"""`pdserve bench compare`: colocated vs chunked vs disaggregated pdserve on the same workload,
and beside them any OpenAI-compatible server pdserve did not start (`--endpoint`).

`run_from_args` is the whole story: one `CompareRun` through the stages of
`benchmarks/compare/pipeline.py` (plan, measure, calibrate, set the SLOs, predict, check
equality, build the result). `main` writes the result JSON and draws the report from it
(`table.py`, `markdown.py`, `plots.py`; `--from-json` redraws a saved one). Predictions come
from the simulator on a calibrated device model (`costmodel/sim/compare_predict.py`) and are
labelled "simulated".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.compare import markdown as compare_markdown
from benchmarks.compare import pipeline
from benchmarks.compare import table as compare_table
from benchmarks.compare.args import add_arguments
from cli.output import emit_json

__all__ = ["add_arguments", "main"]


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run every mode and endpoint, predict, check equality; the JSON payload (without provenance)."""
    run = pipeline.plan(args)  # the modes and endpoints, the device, the workload, the calibration file
    pipeline.measure(run)  # each on a fresh server: warm-up, timed run, equality pass
    pipeline.calibrate(run)  # each mode's device model: its own warm-up steps, or the file's
    pipeline.set_slos(run)  # the SLOs goodput counts under
    pipeline.predict(run)  # the simulator on the workload each server saw
    pipeline.check(run)  # greedy equality across modes
    return pipeline.payload(run)


def main(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from cli import CliError  # noqa: PLC0415
    from costmodel.provenance import RESULTS_DIR, write_result  # noqa: PLC0415

    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    if args.from_json:
        try:
            result = json.loads(Path(args.from_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CliError(f"--from-json {args.from_json}: {e}") from None
        name = args.out or Path(args.from_json).stem
        path = Path(args.from_json)
    else:
        payload = run_from_args(args)
        if any(not m.get("endpoint") for m in payload["modes"]):
            name = args.out or f"compare-{Path(args.model).name}-{payload['device'].split(':')[0]}"
        else:  # --modes none: the servers measured are the endpoints
            name = args.out or "compare-" + "-".join(m["label"] for m in payload["modes"])
        config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "from_json"}
        path = write_result(name, payload, config, out_dir)
        result = json.loads(path.read_text())
    files = compare_markdown.write_report(result, out_dir, name, result_path=path)
    table = compare_table.format_table(result)
    if args.json:
        emit_json(
            {
                "result_file": str(path),
                "report": str(files.markdown),
                "plots": [str(p) for p in files.plots],
                "equality": result["equality"],
                "summary": compare_table.summary_rows(result),
            }
        )
    else:
        print(table)
        from benchmarks.compare.link_probe import format_table  # noqa: PLC0415

        link_table = format_table(result)
        if link_table:
            print("\nEach document alone on the link (mean over documents):\n" + link_table)
        print(f"result: {path}\nreport: {files.markdown}\nplots:  " + ", ".join(str(p) for p in files.plots))
    eq = result["equality"]
    if eq.get("identical") is False and eq.get("only_near_ties"):
        print(compare_table.near_tie_note(eq), file=sys.stderr)
    elif eq.get("identical") is False:
        print(compare_table.mismatch_banner(eq), file=sys.stderr)
        return 1
    if any(m.get("error") for m in result["modes"]):
        print(
            "pdserve bench compare: some modes failed: "
            + "; ".join(f"{m['label']}: {m['error']}" for m in result["modes"] if m.get("error")),
            file=sys.stderr,
        )
        return 1
    return 0
