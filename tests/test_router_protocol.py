"""The HTTP layer without workers: request validation (every bad input gets its 4xx and an
OpenAI-style body), the chat template, stop strings, response shapes, ServeConfig. The app's own
logic over tests/fakes.FakeOrchestrator is in tests/test_router_app.py; serving through real workers
is tested in the serving tests."""

from __future__ import annotations

import json
import math

import pytest

from engine.checkpoint.tokenizer import ByteTokenizer
from router.config import ConfigError, ServeConfig
from router.openai import protocol as oa
from router.openai import responses as oar

TOK = ByteTokenizer()
LIM = oa.Limits("tiny", frozenset({"tiny"}), context_len=64, vocab_size=320, max_tokens_limit=32)


def completion(**body):
    return oa.prepare_completion({"model": "tiny", "prompt": "hello", **body}, TOK, LIM)


def chat(**body):
    return oa.prepare_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}, TOK, LIM)


def error_of(fn, *a, **kw) -> oa.OpenAIError:
    with pytest.raises(oa.OpenAIError) as e:
        fn(*a, **kw)
    body = e.value.body()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return e.value


# ------------------------------------------------------------------------------ validation
def test_valid_completion_is_tokenized_and_sampled_as_asked():
    p = completion(
        max_tokens=5,
        temperature=0,
        top_p=0.5,
        seed=7,
        stop=["\n"],
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        user="u",
        unknown_field=1,
    )
    assert p.prompt_ids == list(b"hello") and p.kind == "completion" and p.model == "tiny"
    assert (p.params.max_tokens, p.params.temperature, p.params.top_p, p.params.seed, p.params.ignore_eos) == (
        5,
        0.0,
        0.5,
        7,
        True,
    )
    assert p.stop == ("\n",) and p.stream and p.include_usage


@pytest.mark.parametrize(
    "prompt, ids",
    [
        ([104, 105], [104, 105]),
        (["hi"], list(b"hi")),
        ([[1, 2, 3]], [1, 2, 3]),
    ],
)
def test_prompt_forms(prompt, ids):
    assert completion(prompt=prompt).prompt_ids == ids


def test_openai_defaults():
    p = completion()
    assert (p.params.max_tokens, p.params.temperature, p.params.top_p) == (16, 1.0, 1.0)  # OpenAI's defaults
    assert not p.stream and not p.include_usage
    assert oa.prepare_completion({"prompt": "x"}, TOK, LIM).model == "tiny"  # model may be omitted
    # chat without max_tokens: as many as fit the context, capped by the server's limit
    prompt_len = len(oa.render_chat([oa.ChatMessage(role="user", content="hi")]).encode())
    assert chat().params.max_tokens == min(LIM.max_tokens_limit, LIM.context_len - prompt_len)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"seed": 1.5}, "seed"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [True, 1]}, "prompt"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
        ({"model": 3}, "model"),
    ],
)
def test_wrong_types_are_400_naming_the_param(body, param):
    e = error_of(completion, **body)
    assert e.status == 400 and e.param == param and e.type == "invalid_request_error"


def test_missing_prompt_and_messages():
    e = error_of(oa.prepare_completion, {"model": "tiny"}, TOK, LIM)
    assert (e.status, e.param, e.code) == (400, "prompt", "missing_required_parameter")
    e = error_of(oa.prepare_chat, {"model": "tiny"}, TOK, LIM)
    assert (e.status, e.param) == (400, "messages")


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"prompt": "x",}'])
def test_malformed_json(raw):
    e = error_of(oa.parse_json, raw)
    assert (e.status, e.code) == (400, "invalid_json")


@pytest.mark.parametrize("body", [[], "prompt", 3, None])
def test_body_must_be_an_object(body):
    assert error_of(oa.prepare_completion, body, TOK, LIM).status == 400


def test_unknown_model_is_404():
    e = error_of(completion, model="gpt-4")
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found") and "gpt-4" in e.message


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_tokens": -3}, "max_tokens", None),
        ({"max_tokens": 33}, "max_tokens", None),  # over the server's limit
        ({"prompt": "x" * 40, "max_tokens": 30}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "x" * 64}, "prompt", "context_length_exceeded"),  # the prompt alone fills it
        ({"prompt": ""}, "prompt", None),
        ({"prompt": []}, "prompt", None),
        ({"prompt": [1, 320]}, "prompt", None),
        ({"prompt": [-1]}, "prompt", None),  # outside the vocabulary
        ({"prompt": ["a", "b"]}, "prompt", None),  # batched prompts
        ({"temperature": -0.1}, "temperature", None),
        ({"temperature": 2.5}, "temperature", None),
        ({"temperature": math.nan}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"top_p": 1.5}, "top_p", None),
        ({"top_p": -1}, "top_p", None),
        ({"n": 2}, "n", "unsupported_value"),
        ({"n": 0}, "n", "unsupported_value"),
        ({"logprobs": 21}, "logprobs", None),
        ({"logprobs": -1}, "logprobs", None),
        ({"best_of": 3}, "best_of", "unsupported_value"),
        ({"suffix": "x"}, "suffix", "unsupported_parameter"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),  # without stream
        ({"stop": ""}, "stop", None),
        ({"stop": ["a"] * 17}, "stop", None),
        ({"seed": 1 << 70}, "seed", None),
        ({"stop_token_ids": [999]}, "stop_token_ids", None),
    ],
)
def test_bad_values_are_400(body, param, code):
    e = error_of(completion, **body)
    assert (e.status, e.param, e.code) == (400, param, code)


def test_accepted_edge_values():
    assert completion(n=1, temperature=2, top_p=1, max_tokens=32, presence_penalty=0).params.max_tokens == 32
    assert completion(prompt="x" * 32, max_tokens=32).params.max_tokens == 32  # exactly the context


def test_chat_template_and_content_parts():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": None},
    ]
    p = oa.prepare_chat({"messages": msgs, "max_tokens": 4}, TOK, LIM)
    assert bytes(p.prompt_ids).decode() == "system: be brief\nuser: hello\nassistant: \nassistant: "
    assert p.kind == "chat"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 3}, "n"),
    ],
)
def test_bad_chat_requests(body, param):
    e = error_of(chat, **body)
    assert (e.status, e.param) == (400, param)


def test_logprobs_settings():
    p = completion(logprobs=3, echo=True, prompt="hi")
    assert (p.logprobs, p.echo, p.prompt_text, p.params.logprobs, p.params.prompt_logprobs) == (3, True, "hi", 3, 3)
    p = completion(logprobs=0)
    assert (p.params.logprobs, p.params.prompt_logprobs, p.echo) == (0, None, False)
    assert completion(echo=True, prompt=[104, 105]).prompt_text == "hi"  # ids echo as their text
    assert completion().params.logprobs is None
    assert chat(logprobs=True, top_logprobs=2).params.logprobs == 2
    assert chat(logprobs=True).params.logprobs == 0 and chat(logprobs=False).params.logprobs is None


def test_max_completion_tokens_wins():
    assert chat(max_completion_tokens=3).params.max_tokens == 3
    assert chat(max_tokens=3, max_completion_tokens=3).params.max_tokens == 3


# ------------------------------------------------------------------------------ stop strings
def feed(stops, deltas):
    f = oar.StopFilter(tuple(stops))
    out = [f.push(d) for d in deltas]
    return out, f


def test_stop_string_split_across_tokens_is_never_emitted():
    out, f = feed(["END"], ["ab", "cE", "N", "Dxyz"])
    assert out == ["ab", "c", "", ""] and f.stopped and "".join(out) == "abc"


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    out, f = feed(["END"], ["aE", "Nx", "y"])
    assert out == ["a", "ENx", "y"] and not f.stopped


def test_held_tail_is_flushed_at_the_end():
    out, f = feed(["END"], ["abE", "N"])
    assert out == ["ab", ""] and f.finish() == "EN"


def test_earliest_of_several_stops_wins():
    out, f = feed(["world", "lo"], ["hello world"])
    assert out == ["hel"] and f.stopped
    assert f.push("more") == "" and f.finish() == ""


def test_stop_at_start_and_no_stops():
    assert feed(["x"], ["xyz"])[0] == [""]
    assert feed([], ["a", "b"])[0] == ["a", "b"]


# ------------------------------------------------------------------------------ response shapes
P_CMPL = completion(stream=True)
P_CHAT = chat(stream=True, stream_options={"include_usage": True})


def test_full_responses():
    use = oar.usage(5, 3)
    assert use == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    r = oar.full_response(completion(), "cmpl-1", 100, "abc", "length", use, {"transfer": {"gbytes_per_s": math.inf}})
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "abc"
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"] == use
    assert r["pdserve"]["timeline"]["transfer"]["gbytes_per_s"] is None  # strict JSON has no inf
    json.dumps(r, allow_nan=False)
    r = oar.full_response(chat(), "chatcmpl-1", 100, "hi", "stop", use, None)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_stream_chunks():
    c = oar.stream_chunk(P_CHAT, "chatcmpl-1", 1, "a", None, first=True)
    assert c["object"] == "chat.completion.chunk" and c["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert oar.stream_chunk(P_CHAT, "x", 1, "", None)["choices"][0]["delta"] == {"content": ""}
    last = oar.stream_chunk(P_CHAT, "x", 1, "", "stop", timeline={"a": 1})
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert last["pdserve"] == {"timeline": {"a": 1}}
    c = oar.stream_chunk(P_CMPL, "cmpl-1", 1, "t", None)
    assert c["choices"][0] == {"index": 0, "text": "t", "logprobs": None, "finish_reason": None}
    u = oar.usage_chunk(P_CMPL, "cmpl-1", 1, oar.usage(1, 2), None)
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 3 and "pdserve" in u
    assert oar.sse({"a": 1}) == 'data: {"a":1}\n\n' and oar.SSE_DONE == "data: [DONE]\n\n"
    assert oar.new_request_id("completion").startswith("cmpl-") and oar.new_request_id("chat").startswith("chatcmpl-")


# ------------------------------------------------------------------------------ ServeConfig
def test_config_yaml_then_flags(tmp_path):
    y = tmp_path / "serve.yaml"
    y.write_text("mode: colocated\nchunk-size: 64\ndecode: 2\nport: 9000\ndecode_resources: {decode_node: 1}\n")
    cfg = ServeConfig.build({"port": 9100, "decode": None}, y)
    assert (cfg.mode, cfg.chunk_size, cfg.decode, cfg.port) == ("colocated", 64, 2, 9100)
    assert cfg.decode_resources == {"decode_node": 1}
    wc = cfg.worker_config()
    assert (wc.chunk_size, wc.model, wc.num_blocks) == (64, "smollm2-135m-instruct", 1024)  # the real default
    assert cfg.model_name == "smollm2-135m-instruct" and ServeConfig(served_model_name="m").model_name == "m"
    assert ServeConfig(model="tiny").model_name == "tiny"


@pytest.mark.parametrize(
    "yaml_text, needle",
    [
        ("prefil: 2\n", "'prefil'"),
        ("- a\n", "mapping"),
        ("port: [1\n", "not valid YAML"),
        ("port: eighty\n", "--port"),
        ("chunk_size: 1.5\n", "--chunk-size"),
        ("prefill_resources: {node: -1}\n", "prefill_resources"),
    ],
)
def test_config_yaml_errors_name_the_key(tmp_path, yaml_text, needle):
    y = tmp_path / "bad.yaml"
    y.write_text(yaml_text)
    with pytest.raises(ConfigError, match=needle):
        ServeConfig.build({}, y)


@pytest.mark.parametrize(
    "flags, needle",
    [
        ({"mode": "both"}, "--mode"),
        ({"model": "/no/such/dir"}, "--model"),
        ({"prefill": 0}, "--prefill"),
        ({"decode": 0}, "--decode"),
        ({"chunk_size": 0}, "--chunk-size"),
        ({"policy": "random"}, "--policy"),
        ({"port": 70000}, "--port"),
        ({"max_queue": 0}, "--max-queue"),
        ({"transport": "tcp"}, "--transport"),
        ({"kv_dtype": "int4"}, "--kv-dtype"),
        ({"device": "tpu"}, "--device"),
        ({"api_key": " "}, "--api-key"),
        ({"gpus_per_worker": -1}, "--gpus-per-worker"),
        ({"lease_s": 0}, "--lease-s"),
        ({"transfer_timeout_s": -1}, "--transfer-timeout-s"),
    ],
)
def test_config_flag_errors_name_the_flag(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        ServeConfig.build(flags)
    assert ServeConfig.build({"mode": "colocated", "prefill": 0}).prefill == 0  # no prefill pool when colocated


def test_serve_cli_flags(tmp_path):
    from cli import build_parser
    from router.serve_cli import config_from_args, ready_message

    y = tmp_path / "s.yaml"
    y.write_text("decode: 3\npolicy: least_loaded\n")
    argv = ["serve", "--mode", "colocated", "--chunk-size", "128", "--config", str(y), "--port", "0", "--api-key", "k"]
    cfg = config_from_args(build_parser(argv).parse_args(argv))
    assert (cfg.mode, cfg.chunk_size, cfg.decode, cfg.policy, cfg.port, cfg.api_key) == (
        "colocated",
        128,
        3,
        "least_loaded",
        0,
        "k",
    )
    msg = ready_message(cfg, "http://127.0.0.1:8000")
    assert "http://127.0.0.1:8000/v1/completions" in msg and "Bearer" in msg and "'k'" not in msg
