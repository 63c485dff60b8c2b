"""A failing engine step fails the requests in that step and nothing else: the decode worker keeps
running, queued prompts and later requests are served with their greedy tokens, every block comes
back. (In-process colocated worker; the step is made to raise once.)"""

from __future__ import annotations

from contracts.worker import GenerateRequest, StreamEvent, WorkerConfig
from decode_worker.worker import DecodeWorker
from engine.sequence import SamplingParams
from tests.helpers import wait_until


def _events(d: DecodeWorker, rids: set[str], timeout_s: float = 30.0) -> dict[str, list[StreamEvent]]:
    out: dict[str, list[StreamEvent]] = {r: [] for r in rids}

    def finished() -> bool:
        for ev in d.poll_events(0.05):  # waits up to 50 ms itself
            out.setdefault(ev.request_id, []).append(ev)
        return all(evs and evs[-1].finished for evs in out.values())

    wait_until(
        finished,
        timeout_s,
        lambda: f"every request to finish (events so far: { {r: len(e) for r, e in out.items()} })",
        interval=0,
    )
    return out


def _req(rid: str, n: int = 12) -> GenerateRequest:
    return GenerateRequest(rid, list(b"a failing step " + rid.encode()), SamplingParams(max_tokens=n, ignore_eos=True))


def test_failed_step_fails_its_batch_and_the_worker_keeps_serving(monkeypatch):
    d = DecodeWorker(WorkerConfig(model="tiny", num_blocks=32), "step-fail", True)
    try:
        d.submit_prompt(_req("ref"))
        want = [e.token_id for e in _events(d, {"ref"})["ref"] if e.kind == "token"]
        real, calls = d.engine.runner.execute, []

        def execute_failing_once(decode, items, on_layer=None):
            calls.append(len(items))
            if len(calls) == 3:  # mid-decode of "victim"
                raise RuntimeError("injected: NaN in the logits")
            return real(decode, items, on_layer)

        monkeypatch.setattr(d.engine.runner, "execute", execute_failing_once)
        d.submit_prompt(_req("victim", 40))
        victim = _events(d, {"victim"})["victim"]
        assert victim[-1].kind == "error" and "engine step failed" in victim[-1].error
        assert "NaN in the logits" in victim[-1].error
        assert d.ping() == "step-fail"  # the worker lives on
        d.submit_prompt(_req("ref"))
        assert [e.token_id for e in _events(d, {"ref"})["ref"] if e.kind == "token"] == want
        s = d.stats()
        assert s.blocks_free == s.blocks_total
    finally:
        d.shutdown()


def test_failed_prefill_step_fails_its_prompt_and_the_worker_keeps_serving(monkeypatch):
    import pytest

    from contracts.worker import WorkerError
    from prefill_worker.worker import PrefillWorker

    p = PrefillWorker(WorkerConfig(model="tiny", num_blocks=32, transport="local"), "prefill-step-fail")
    try:
        want = p.prefill(_req("ref")).first_token
        p.release("ref")
        real, calls = p.engine.runner.execute, []

        def execute_failing_once(decode, items, on_layer=None):
            calls.append(len(items))
            if len(calls) == 1:
                raise RuntimeError("injected: a kernel error")
            return real(decode, items, on_layer)

        monkeypatch.setattr(p.engine.runner, "execute", execute_failing_once)
        with pytest.raises(WorkerError, match="prefill step failed: .*a kernel error"):
            p.prefill(_req("victim"))
        assert p.ping() == "prefill-step-fail"
        again = p.prefill(_req("ref"))
        assert again.first_token == want
        p.release("ref")
        s = p.stats()
        assert s.blocks_free == s.blocks_total
    finally:
        p.shutdown()
