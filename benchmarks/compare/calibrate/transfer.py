"""`bench compare --transfer-from RESULT`: each mode predicted from what an earlier run measured.

By default a mode is predicted from the steps its own server ran in this run's warm-up, whose
schedule and prompt lengths are the timed run's: *replay* accuracy. A user plans the other way
round: a server measured on one workload, a prediction wanted for another. This module takes an
earlier `bench compare` result and, for each mode label it shares with this run, rebuilds the
device model that run fitted to its own server (the step-cost fits per pool, prompt steps on their
own threads included), with that run's decode admission delay and serving hop: nothing measured
in this run reaches the prediction, so its error is *transfer* accuracy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.client.logged_step import LoggedStep
from benchmarks.compare.calibrate.calibration import SelfCalibration, prediction_setup
from benchmarks.compare.calibrate.pooled import Server, pooled
from costmodel.sim.compare_predict import PredictionSetup


@dataclass(frozen=True)
class Transferred:
    """One mode's device model from the earlier run, and that run's serving hop."""

    setup: PredictionSetup
    hop_s: float
    basis: dict[str, Any]
    kind: str = "colocated"  # the deployment it was fitted on: "colocated", "chunked" or "disagg"
    workers: int = 1  # colocated and chunked: its server's workers (on one CPU host they contend)
    chunk: int | None = None  # chunked: the chunk size its server ran
    # the warm-up steps of the servers its fit came from (serving_pace.py reads this run's against them)
    source_steps: tuple[LoggedStep, ...] = ()


def is_compare_result(path: Path) -> bool:
    """Whether `path` holds a `bench compare` result (not a calibration file)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    config = ((doc.get("provenance") or {}).get("config") or {}) if isinstance(doc, dict) else {}
    return config.get("bench_command") == "compare"


def measured_on(path: Path) -> str | None:
    """The CPU the result at `path` was measured on, as its provenance names it (None: unsaid)."""
    try:
        prov = json.loads(Path(path).read_text()).get("provenance") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return (prov.get("machine") or {}).get("cpu") or prov.get("cpu")


def by_kind(found: dict[str, Transferred]) -> dict[str, PredictionSetup]:
    """One device model per deployment kind (the first mode of each kind found): "colocated",
    "chunked", "disagg", and "colocated xN"/"chunked xN" where a server ran N workers (the kind
    alone is its fewest workers' fit, the smallest chunk's); and one per chunk size run, "chunked
    C" / "chunked C xN" (`costmodel.plan.pricing.setup_for` picks)."""
    out: dict[str, PredictionSetup] = {}
    for t in sorted(found.values(), key=lambda t: (t.workers, t.chunk or 0)):
        n = f" x{t.workers}" if t.workers > 1 else ""
        if t.workers > 1:
            out.setdefault(f"{t.kind}{n}", t.setup)
        out.setdefault(t.kind, t.setup)
        if t.chunk:  # each chunk size its own too, named as the plan's candidates are ("chunked 256 x2")
            out.setdefault(f"chunked {t.chunk}{n}", t.setup)
    return out


def load(path: Path, model: str) -> tuple[dict[str, Transferred], dict[str, str]]:
    """(mode label -> its transferred device model, mode label -> why it has none) from the
    result JSON at `path`. Raises ValueError if the file is not a `bench compare` result of `model`."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--transfer-from {path}: {e}") from e
    config = (doc.get("provenance") or {}).get("config") or {}
    if config.get("bench_command") != "compare" or not isinstance(doc.get("modes"), list):
        raise ValueError(f"--transfer-from {path}: not a `pdserve bench compare` result")
    if config.get("model") != model:
        raise ValueError(f"--transfer-from {path}: measured {config.get('model')!r}, this run serves {model!r}")
    found: dict[str, Transferred] = {}
    missing: dict[str, str] = {}
    cals: dict[str, SelfCalibration] = {}  # by this version's step model
    servers: dict[str, Server] = {}  # the colocated-kind ones, chunked or not: `pooled` shares their fit
    paces: dict[str, float] = {}  # the machine's pace before each server started (benchmarks/pace.py)
    for m in doc["modes"]:
        label, spec = m.get("label"), m.get("spec") or {}
        if label and (pace := (m.get("machine_pace") or {}).get("gemm_gflops_1thread")):
            paces[label] = pace
        if label and m.get("self_calibration") and spec.get("mode") is not None:
            cals[label] = SelfCalibration.from_dict(m["self_calibration"]).refitted()
            if spec["mode"] == "colocated":
                servers[label] = Server(label, cals[label], int(spec.get("decode") or 1))
    shared = pooled(servers)
    for m in doc["modes"]:
        label = m.get("label")
        mode = (m.get("spec") or {}).get("mode")
        if not label or mode is None:
            continue
        if label not in cals:
            missing[label] = f"{path} has no self-calibration for {label}"
            continue
        cal, with_ = shared.get(label, (cals[label], [label]))
        setup, why = prediction_setup(model, mode, cal)
        if setup is None:
            missing[label] = f"{path}: {why}"
            continue
        if setup.longest_prompt is None:  # a result written before the field: its timed run's prompts
            lens = [r.get("prompt_tokens") or r.get("prompt_len") or 0 for r in m.get("records") or []]
            setup = replace(setup, longest_prompt=max(lens) or None if lens else None)
        basis = m.get("prediction_basis") or {}
        admit_ms = basis.get("decode_admission_ms") or 0.0
        hop_ms = (m.get("serving_overhead") or {}).get("hop_ms") or 0.0
        warmups = f"{label}'s warm-up" if len(with_) == 1 else f"the warm-ups of {' and '.join(with_)} (one engine)"
        source = f"transfer: fitted to {cal.steps} steps of {warmups} in {path}"
        known = [paces[x] for x in with_ if x in paces]  # a pooled fit: its servers' mean pace
        pace = sum(known) / len(known) if known else None
        setup = replace(
            setup, source=source, kind="transfer", admit_s=admit_ms / 1e3, hop_s=hop_ms / 1e3, pace_gflops=pace
        )
        spec = m.get("spec") or {}
        kind = "chunked" if mode == "colocated" and spec.get("chunk_size") else mode
        workers = int(spec.get("decode") or 1) if mode == "colocated" else 1
        found[label] = Transferred(
            setup,
            hop_ms / 1e3,
            {
                "used": "transfer",
                "why": f"--transfer-from {path} (that run's warm-up, decode admission and serving hop)",
                "source": source,
                "fitted_steps": cal.steps,
                "warning": None,
                "decode_admission_ms": admit_ms,
                "decode_slowdown_beside_prefill": setup.decode_slowdown,
                "prefill_slowdown_beside_decode": setup.prefill_slowdown,
                "transfer_hop_ms": hop_ms,
            },
            kind,
            workers,
            spec.get("chunk_size") if kind == "chunked" else None,
            tuple(s for x in with_ for s in cals[x].logged),
        )
    return found, missing
