"""`StepLogRecorder`: a pdserve server's step log (`GET /v1/workers/steps`), polled in the
background while `bench compare` runs a warm-up, each step kept once (calibration.py fits them)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks.client.logged_step import LoggedStep
from costmodel.fit.step_fit import StepShape

POLL_S = 1.0  # a worker keeps its last 256 steps; at >= 4 ms a step none is missed between polls


class StepLogRecorder:
    """Polls a pdserve server's step log in a background thread while the caller runs load.

    with StepLogRecorder(root_url, api_key) as rec:
        ...                      # the warm-up
    rec.steps                    # every step seen, each once
    """

    def __init__(self, root_url: str, api_key: str | None = None, poll_s: float = POLL_S):
        self.url = root_url.rstrip("/") + "/v1/workers/steps"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.poll_s = poll_s
        self._seen: dict[tuple[str, int], LoggedStep] = {}
        # each worker's last step before the recording began: the step log holds the last 256
        # steps, so without this the first poll brought the cold pass's steps into the fit
        self._before: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-log-recorder", daemon=True)
        self.error: str | None = None

    def __enter__(self) -> StepLogRecorder:
        try:
            self.mark_start(self._get())
        except (httpx.HTTPError, KeyError, ValueError) as e:
            self.error = f"{type(e).__name__}: {e}"  # then every step the polls see is kept
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll_once()  # the steps of the last second

    @property
    def steps(self) -> list[LoggedStep]:
        return list(self._seen.values())

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll_once()

    def _get(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url, headers=self.headers, timeout=10.0)
        r.raise_for_status()
        return list(r.json()["data"])

    def _poll_once(self) -> None:
        try:
            self.add(self._get())
        except (httpx.HTTPError, KeyError, ValueError) as e:
            self.error = f"{type(e).__name__}: {e}"  # the fit says it had no steps; the run goes on

    def mark_start(self, workers: Sequence[dict[str, Any]]) -> None:
        """One `GET /v1/workers/steps` answer's `data`, read as the recording begins: the steps in
        it ran before (an earlier pass, cold) and are never recorded."""
        for w in workers:
            self._before[w["worker"]] = max((int(s["step"]) for s in w["steps"]), default=-1)

    def add(self, workers: Sequence[dict[str, Any]]) -> None:
        """One `GET /v1/workers/steps` answer's `data`: its steps since the recording began."""
        for w in workers:
            before = self._before.get(w["worker"], -1)
            for s in w["steps"]:
                if int(s["step"]) <= before:
                    continue
                dpairs = s.get("decode_pairs")
                shape = StepShape.reported(
                    int(s["prefill_tokens"]),
                    float(s["attention_pairs"]),
                    int(s["decode_seqs"]),
                    None if dpairs is None else float(dpairs),
                    s.get("prefill_seqs"),  # None from a worker of an earlier version
                    s.get("prefill_reads"),
                )
                self._seen[(w["worker"], int(s["step"]))] = LoggedStep(
                    w["worker"],
                    w["role"],
                    shape,
                    s["seconds"],
                    float(s.get("end_unix_s", 0.0)),
                    int(s.get("torch_threads", w.get("torch_threads", 0))),
                )
