"""Provenance for every result file: what produced a number, where and when."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from costmodel.machine import cpu_model, git

# Committed reference results (written only when asked: `--out-dir benchmarks/results`)...
REFERENCE_RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# ...and where every run writes by default: ignored by git, so running a benchmark (or `make demo`)
# never dirties the checkout.
RESULTS_DIR = REFERENCE_RESULTS_DIR / "local"
OUT_DIR_HELP = (
    "default benchmarks/results/local/, ignored by git (--out-dir benchmarks/results: the committed reference)"
)


def device_description() -> dict[str, Any]:
    """The accelerator if torch sees one, else the CPU."""
    info: dict[str, Any] = {"kind": "cpu", "name": cpu_model(), "cores": os.cpu_count()}
    try:
        import torch  # noqa: PLC0415 - provenance must not force torch on pure-Python tools

        if torch.cuda.is_available():
            info = {
                "kind": "cuda",
                "name": torch.cuda.get_device_name(0),
                "count": torch.cuda.device_count(),
                "cuda": torch.version.cuda,
            }
        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def provenance(config: dict[str, Any] | None = None) -> dict[str, Any]:
    dirty = git("status", "--porcelain")
    return {
        "command": " ".join(["pdserve" if Path(sys.argv[0]).name == "pdserve" else sys.argv[0], *sys.argv[1:]]),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "hostname": platform.node(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
        },
        "device": device_description(),
        "config": config or {},
    }


def write_result(
    name: str, payload: dict[str, Any], config: dict[str, Any] | None = None, out_dir: Path | None = None
) -> Path:
    """Write `payload` plus provenance to results/<name>.json and return the path."""
    out_dir = Path(out_dir) if out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"provenance": provenance(config), **payload}, indent=2, default=str) + "\n")
    return path


# ---- calibration files -------------------------------------------------------------------------
def calibration_provenance() -> dict[str, Any]:
    """Where a calibration was measured: a calibration prices steps of one engine build on one
    machine, and a consumer elsewhere must be told (see `calibration_mismatch`)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": device_description().get("torch"),
        "device": device_description().get("name"),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "load_average": load,
    }


def save_calibration(cal: Any, path: str | Path) -> Path:
    """Write a `cost_model.Calibration` as JSON, stamped with where and when it was measured
    (unless it already is)."""
    from dataclasses import replace  # noqa: PLC0415

    if not cal.provenance:
        cal = replace(cal, provenance=calibration_provenance())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal.to_dict(), indent=2) + "\n")
    return path
