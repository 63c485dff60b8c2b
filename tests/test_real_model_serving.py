"""The real default model served end to end: Ray pools, NIXL, uvicorn on 127.0.0.1 and the
official `openai` client, with the server's default settings (disaggregated 1P1D, FP8 weights
and KV, the model's own chat template)."""

from __future__ import annotations

import os
import tempfile

import pytest

ray = pytest.importorskip("ray")
from openai import OpenAI  # noqa: E402

from engine.model_registry import DEFAULT_MODEL  # noqa: E402
from router.config import ServeConfig  # noqa: E402
from router.serve_cli import ServerThread  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ray_cluster(smollm2):  # smollm2: pulled before the workers start
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")  # short: Ray's socket paths are length-limited
    ray.init(
        num_cpus=8,
        object_store_memory=128 * 1024**2,
        include_dashboard=False,
        _temp_dir=temp,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def default_server(ray_cluster):
    cfg = ServeConfig(model=DEFAULT_MODEL, num_blocks=128)  # every other setting: the defaults
    with ServerThread(cfg, startup_timeout_s=240) as srv:
        yield srv


def test_chat_answers_a_factual_question(default_server):
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
