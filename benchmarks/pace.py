"""The machine's pace now: a one-thread fp32 GEMM and a 64 MiB copy, in a child process (~2 s).

A VM's speed drifts with the other tenants of its host: on the 2-core dev VM the same
2,058-token prefill on one thread took 7.4 s at 05:14 UTC and 8.5 s at 07:11 (2026-12-05, two
`bench compare` runs of one schedule), and a `--verify` run at 07:14 measured every candidate
slower than the one at 05:19 had. A prediction fitted at one pace and checked at another carries
the difference in its error, so `bench compare` (each mode, before its server starts) and `plan
--verify` (each candidate) record the pace they ran at, and the reader can tell a slower machine
from a wrong model. The child keeps torch (and its threads) out of the process that hosts the
router and the client.

    python -m benchmarks.pace   # one JSON line: {"gemm_gflops_1thread": ..., "copy_gbps": ...}
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

GEMM_N = 512  # one thread, fp32: ~0.3 ms a product on the dev VM, long enough to time, short enough to repeat
COPY_MIB = 64


MAX_AGE_S = 30.0  # a pace this fresh is reused: servers started seconds apart (tests) share one reading

_last: tuple[float, dict[str, Any]] | None = None


def machine_pace(timeout_s: float = 60.0) -> dict[str, Any] | None:
    """The pace measured in a child process (or the last one, if under MAX_AGE_S old); None if it
    could not run (said, not raised: the benchmark it belongs to goes on without it)."""
    global _last
    if _last is not None and time.monotonic() - _last[0] < MAX_AGE_S:
        return _last[1]
    try:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.pace"], capture_output=True, text=True, timeout=timeout_s, check=True
        )
        pace = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"machine pace not measured: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    _last = (time.monotonic(), pace)
    return pace


def describe(pace: dict[str, Any] | None) -> str:
    if not pace:
        return "pace not measured"
    return f"pace {pace['gemm_gflops_1thread']:.0f} GFLOP/s (1-thread GEMM), {pace['copy_gbps']:.1f} GB/s copy"


def _measure() -> dict[str, Any]:
    import torch  # noqa: PLC0415 - the child only

    from benchmarks.engine.device_probe import probe_device  # noqa: PLC0415

    torch.set_num_threads(1)
    p = probe_device(torch.device("cpu"), gemm_dtype="fp32", copy_mib=COPY_MIB, gemm_n=GEMM_N, repeats=7)
    gemm = p.gemm_tflops * 1e3
    return {"gemm_gflops_1thread": gemm, "copy_gbps": p.copy_gbps, "gemm_n": GEMM_N, "copy_mib": COPY_MIB}


if __name__ == "__main__":
    print(json.dumps(_measure()))
