"""`--mode auto` end to end through real parts (Ray actors, NIXL on host memory, uvicorn on
127.0.0.1, the official openai client): each request is placed by the cost model, the placement
and both predictions land in its timeline, the tokens are the engine's greedy tokens whichever
way it went, and /metrics counts the decisions.

The SLO pair steers the two branches deterministically: with no stream in flight a local
prefill stalls nobody and skips the KV transfer, so it is chosen; with a stream in flight an
inter-token SLO of 1 microsecond makes every local prefill inadmissible, so it goes remote.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

ray = pytest.importorskip("ray")
from openai import OpenAI  # noqa: E402

from costmodel.article.cost_model import Calibration  # noqa: E402
from costmodel.fit.step_fit import StepCostFit  # noqa: E402
from engine.checkpoint.tokenizer import ByteTokenizer  # noqa: E402
from engine.config import PRESETS, CacheConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.sequence import SamplingParams, Sequence  # noqa: E402
from router.config import ConfigError, ServeConfig  # noqa: E402
from router.serve_cli import ServerThread  # noqa: E402
from tests.helpers import value  # noqa: E402

# Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server]

# The stream is long enough (hundreds of decode steps) to still be in flight, under CI load, when
# the second request is dispatched: 48 tokens once finished first and the second request saw no stream.
STREAM_PROMPT, STREAM_TOKENS = "Hello, pdserve!", 400
DOC_PROMPT, DOC_TOKENS = "A long document about disaggregated serving. " * 3, 8


def reference(prompt: str, max_tokens: int) -> list[int]:
    runner = ModelRunner(PRESETS["tiny"], CacheConfig(num_blocks=64), "fp8", "cpu")
    engine = LLMEngine(runner)
    seq = Sequence("ref", ByteTokenizer().encode(prompt), SamplingParams(max_tokens, ignore_eos=True))
    engine.add_request(seq)
    while engine.has_work:
        engine.step()
    return seq.output_ids


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    # Terms of the size `pdserve bench chunks` fits for `tiny` on a 2-core CPU.
    fit = StepCostFit(0.006, 60e-6, 0.1e-6, 1.5e-3)
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    cal = Calibration(device="cpu", dtype="fp32", mem_bandwidth_gbps=10.0, peak_tflops=0.1, step_fit=fit.to_dict())
    path.write_text(json.dumps(cal.to_dict()))
    return str(path)


def test_auto_needs_a_prefill_pool_and_a_real_calibration():
    with pytest.raises(ConfigError, match="--prefill"):
        ServeConfig(mode="auto", prefill=0).validate()
    with pytest.raises(ConfigError, match="--calibration"):
        ServeConfig(mode="auto", calibration="/nonexistent.json").validate()
    with pytest.raises(ConfigError, match="--slo-itl-ms"):
        ServeConfig(mode="auto", slo_itl_ms=0).validate()


def test_auto_places_each_request_and_records_why(ray_cluster, calibration):
    """Cost: an auto server (1P1D, two Ray actors) starts, and its stream runs hundreds of decode steps so
    it is still in flight under load when the document arrives."""
    cfg = ServeConfig(
        model="tiny", mode="auto", prefill=1, decode=1, num_blocks=128, chunk_size=32,
        slo_ttft_ms=60_000, slo_itl_ms=0.001, calibration=calibration,
    )  # fmt: skip
    with ServerThread(cfg, startup_timeout_s=180) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        got: dict = {}
        first = threading.Event()

        def stream() -> None:
            chunks = []
            for c in client.completions.create(
                model="tiny", prompt=STREAM_PROMPT, max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                chunks.append(c)
                if len(chunks) >= 4:
                    first.set()
            got["stream"] = chunks[-1].model_extra["pdserve"]["timeline"]

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        # a few decode steps in: the stream is in flight on the one decode worker
        resp = client.completions.create(
            model="tiny", prompt=DOC_PROMPT, max_tokens=DOC_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        t.join(60)
        doc = resp.model_extra["pdserve"]["timeline"]
        streamed = got["stream"]

        assert streamed["token_ids"] == reference(STREAM_PROMPT, STREAM_TOKENS)
        assert doc["token_ids"] == reference(DOC_PROMPT, DOC_TOKENS)

        d0, d1 = streamed["dispatch"], doc["dispatch"]
        assert d0["decision"] == "local" and d0["streams_in_flight"] == 0
        assert d1["decision"] == "remote" and d1["streams_in_flight"] == 1
        assert d1["reason"] == "only remote meets the SLO" and not d1["local"]["admissible"]
        for d in (d0, d1):
            assert d["local"]["ttft_ms"] > 0 and d["remote"]["ttft_ms"] > 0
            assert d["outcome"]["ttft_ms"] > 0 and d["outcome"]["ttft_error"] is not None
        assert d1["local"]["stall_ms"] > 0 and d1["local"]["itl_ms"] > d1["local"]["stall_ms"]
        assert doc["transfer"]["bytes"] > 0 and "transfer" not in streamed  # remote pulled KV, local did not

        text = httpx.get(srv.url + "/metrics", timeout=30).text
        assert value(text, "pdserve_dispatch_decisions_total", decision="local") == 1.0
        assert value(text, "pdserve_dispatch_decisions_total", decision="remote") == 1.0
        assert value(text, "pdserve_dispatch_prediction_abs_rel_error_ratio_count", figure="ttft") == 2.0
