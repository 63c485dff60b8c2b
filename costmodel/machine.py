"""This machine and checkout, as provenance records them: pure Python (no torch), so the router
can check a calibration's origin too."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_mismatch(path: str | Path, prov: dict[str, Any] | None) -> str | None:
    """One line when the calibration at `path` was measured on another CPU or at another commit
    than this checkout (or does not say where it was measured); None when it matches. Pure Python:
    the router calls it and imports no torch."""
    if not prov:
        return f"calibration {path} carries no provenance: it may price another machine or engine build"
    diffs = []
    cpu = cpu_model()
    if prov.get("cpu") and prov["cpu"] != cpu:
        diffs.append(f"CPU {prov['cpu']!r} (here {cpu!r})")
    head = git("rev-parse", "HEAD")
    if prov.get("git_commit") and head and prov["git_commit"] != head:
        diffs.append(f"commit {prov['git_commit'][:10]} (here {head[:10]})")
    if not diffs:
        return None
    return f"calibration {path} was measured on {' and at '.join(diffs)}, {prov.get('date_utc', '?')}"
