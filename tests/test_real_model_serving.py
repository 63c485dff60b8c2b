"""The real default model served end to end: Ray pools, NIXL, uvicorn on 127.0.0.1 and the
official `openai` client, with the server's default settings (disaggregated 1P1D, FP8 weights
and KV, the model's own chat template)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from openai import OpenAI  # noqa: E402

from engine.checkpoint.registry import DEFAULT_MODEL  # noqa: E402
from router.config import ServeConfig  # noqa: E402
from router.serve_cli import ServerThread  # noqa: E402
from tests.ray_session import shared_ray  # noqa: E402

# the real model on Ray actors behind a server
pytestmark = [pytest.mark.ray, pytest.mark.server, pytest.mark.real_model]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ray_cluster(smollm2):  # smollm2: pulled before the workers start
    shared_ray()  # conftest: the session's token-auth cluster
    yield


@pytest.fixture(scope="module")
def default_server(ray_cluster):
    cfg = ServeConfig(model=DEFAULT_MODEL, num_blocks=128)  # every other setting: the defaults
    with ServerThread(cfg, startup_timeout_s=240) as srv:
        yield srv


def test_chat_answers_a_factual_question(default_server):
    """Cost: its setup starts the default server: SmolLM2-135M loaded from the GGUF in every Ray worker."""
    client = OpenAI(base_url=default_server.base_url, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
    resp = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, temperature=0)
    answer = resp.choices[0].message.content
    assert "Paris" in answer, answer
    assert resp.choices[0].finish_reason == "stop"  # ended at the template's end of turn, not a length cap
    assert "<|im_end|>" not in answer and resp.usage.completion_tokens < 40


def test_streamed_chat_equals_the_whole_answer(default_server):
    client = OpenAI(base_url=default_server.base_url, api_key="none", max_retries=0)
    whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, temperature=0)
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def _echo_logprobs(srv) -> tuple[list[int], dict]:
    client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
    resp = client.completions.create(
        model=DEFAULT_MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    c = resp.choices[0]
    assert c.text.startswith("The capital of France is") and len(c.text) > len("The capital of France is")
    lp = c.logprobs
    n = resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    return resp.model_extra["pdserve"]["timeline"]["token_ids"], lp.model_dump()


def test_logprobs_same_in_colocated_and_disagg(default_server):
    """Completions logprobs + echo through the official client, in both modes: the same tokens,
    and logprobs equal within FP8 noise (the KV crosses NIXL as the same FP8 bytes).

    Cost: a second SmolLM2 server (disagg: two more Ray workers loading the model).
    """
    ids_d, lp_d = _echo_logprobs(default_server)
    with ServerThread(
        ServeConfig(model=DEFAULT_MODEL, mode="colocated", num_blocks=128), startup_timeout_s=240
    ) as colocated:
        ids_c, lp_c = _echo_logprobs(colocated)
    assert ids_c == ids_d and lp_c["tokens"] == lp_d["tokens"]
    for a, b in zip(lp_c["token_logprobs"][1:], lp_d["token_logprobs"][1:]):
        assert abs(a - b) < 0.05, (a, b)


def test_chat_logprobs(default_server):
    client = OpenAI(base_url=default_server.base_url, api_key="none", max_retries=0)
    resp = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    joined = b"".join(bytes(t.bytes) for t in content).decode()
    assert joined.startswith(resp.choices[0].message.content)  # + the end-of-turn token's text, if it stopped
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy
