"""Every malformed request gets a 4xx: the two known 500s (deep nesting, lone surrogates) and a
Hypothesis fuzz of the JSON parser and of the tokenizer path (parse -> validate -> tokenize),
through the app over tests/fakes.FakeOrchestrator. Examples are bounded and derandomized, so the
suite stays fast and the same on every run."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.checkpoint.tokenizer import ByteTokenizer, HFTokenizer
from engine.config import PRESETS
from router.config import ServeConfig
from router.http.app import create_app
from router.openai.protocol import Limits, OpenAIError, parse_json, prepare_chat, prepare_completion
from tests.fakes import FakeOrchestrator

FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)
LIM = Limits("tiny", frozenset({"tiny"}), context_len=256, vocab_size=PRESETS["tiny"].vocab_size, max_tokens_limit=64)


def _hf_tokenizer() -> HFTokenizer:
    """A small byte-level BPE from the `tokenizers` library itself (the class real checkpoints use)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["Ġt"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return HFTokenizer(None, bos_id=None, eos_id=None, add_bos=False, json_str=tok.to_str())


TOKENIZERS = {"bytes": ByteTokenizer(), "hf-bpe": _hf_tokenizer()}

# text that includes lone surrogates, the case json.loads accepts ("\ud800") and encoders refuse
surrogates = st.integers(0xD800, 0xDFFF).map(chr)
texts = st.lists(st.one_of(st.characters(), surrogates), max_size=24).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts)
json_values = st.recursive(
    scalars, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(texts, kids, max_size=4)), max_leaves=12
)


def _completion_bodies() -> st.SearchStrategy[dict]:
    prompt = st.one_of(texts, st.lists(st.integers(-5, 600), max_size=8), st.lists(texts, max_size=2), json_values)
    return st.fixed_dictionaries(
        {"model": st.one_of(st.just("tiny"), texts), "prompt": prompt},
        optional={
            "max_tokens": st.one_of(st.integers(-3, 300), json_values),
            "temperature": st.one_of(st.floats(), json_values),
            "top_p": st.floats(),
            "stop": st.one_of(texts, st.lists(texts, max_size=3), json_values),
            "stream": st.one_of(st.booleans(), json_values),
            "seed": st.integers(),
        },
    )


def _chat_bodies() -> st.SearchStrategy[dict]:
    part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), json_values)
    content = st.one_of(texts, st.lists(part, max_size=3), json_values)
    message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "x"]), "content": content}))
    return st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": st.one_of(st.lists(message, max_size=3), json_values)},
        optional={"max_completion_tokens": st.one_of(st.integers(-2, 100), json_values), "stream": st.booleans()},
    )


def _post(path: str, raw: bytes) -> httpx.Response:
    app = create_app(
        FakeOrchestrator(PRESETS["tiny"]), ByteTokenizer(), ServeConfig(model="tiny", num_blocks=64, block_size=16)
    )

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, content=raw, headers={"content-type": "application/json"})

    return asyncio.run(go())


def _assert_4xx_or_ok(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------ the two known 500s
@pytest.mark.parametrize("depth", [33, 5000, 200_000])
def test_deeply_nested_json_is_a_400(depth):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = _post(path, b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}")
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "abc\\ud800def", "max_tokens": 4}'),
        ("/v1/completions", '{"model": "tiny", "prompt": ["\\udfff"], "max_tokens": 4}'),
        ("/v1/completions", '{"model": "tiny", "prompt": "ok", "stop": ["\\ud83d"], "max_tokens": 4}'),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}'),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        ),
    ],
)
def test_lone_surrogate_is_a_400(path, body):
    r = _post(path, body.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_unicode" and "lone surrogate" in r.json()["error"]["message"]


def test_valid_astral_text_is_served():
    """A correctly paired surrogate escape is a real character (an emoji), not an error."""
    r = _post("/v1/completions", b'{"model": "tiny", "prompt": "hi \\ud83d\\ude00", "max_tokens": 3}')
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3 + 4


# ------------------------------------------------------------------------------ fuzz
@FUZZ
@given(st.one_of(st.binary(max_size=64), texts.map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_fuzz_parse_json_raw_bytes(raw):
    try:
        parse_json(raw)
    except OpenAIError as e:
        assert e.status == 400


@FUZZ
@given(_completion_bodies(), st.sampled_from(sorted(TOKENIZERS)))
def test_fuzz_completion_tokenizer_path(body, tok_name):
    """parse -> validate -> tokenize, for both tokenizer kinds: a Prepared or a 400, nothing else."""
    raw = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as \\udXXX escapes
    try:
        prepare_completion(parse_json(raw), TOKENIZERS[tok_name], LIM)
    except OpenAIError as e:
        assert 400 <= e.status < 500


@FUZZ
@given(_chat_bodies(), st.sampled_from(sorted(TOKENIZERS)))
def test_fuzz_chat_tokenizer_path(body, tok_name):
    raw = json.dumps(body, ensure_ascii=True).encode()
    try:
        prepare_chat(parse_json(raw), TOKENIZERS[tok_name], LIM)
    except OpenAIError as e:
        assert 400 <= e.status < 500


@settings(FUZZ, max_examples=60)
@given(st.one_of(_completion_bodies(), json_values))
def test_fuzz_completions_endpoint(body):
    """Through the whole app (FastAPI, error handlers, the fake orchestrator): never a 5xx."""
    _assert_4xx_or_ok(_post("/v1/completions", json.dumps(body, ensure_ascii=True).encode()))


@settings(FUZZ, max_examples=60)
@given(_chat_bodies())
def test_fuzz_chat_endpoint(body):
    _assert_4xx_or_ok(_post("/v1/chat/completions", json.dumps(body, ensure_ascii=True).encode()))
