"""Where `pdserve bench compare` finds a calibration file for its predictions.

Kept on its own so that the rule for finding one can change without touching the command:
callers need only `find_calibration`'s answer, a path that may not exist.
"""

from __future__ import annotations

from pathlib import Path


def find_calibration(given: str | None, out_dir: Path, model: str, device_kind: str) -> Path:
    """--calibration, else `bench chunks`' file for this model and device in --out-dir, else in
    benchmarks/results/local/, else the committed one in benchmarks/results/."""
    from costmodel.provenance import REFERENCE_RESULTS_DIR, RESULTS_DIR  # noqa: PLC0415
    from costmodel.sim import compare_predict as cp  # noqa: PLC0415

    if given:
        return Path(given)
    candidates = [
        cp.default_calibration_path(d, Path(model).name, device_kind)
        for d in (out_dir, RESULTS_DIR, REFERENCE_RESULTS_DIR)
    ]
    return next((c for c in candidates if c.is_file()), candidates[-1])
