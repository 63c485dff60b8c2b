"""The OpenAI wire protocol, request side, as pure functions: the request models, validation,
sampling parameters. The body's JSON and the error type are router/openai/body.py, a chat's
messages and template router/openai/chat_prompt.py; their names are re-exported here, so callers
import the protocol from this one module. router/openai/responses.py shapes what goes back. Nothing here
touches the network or the workers, so every rule can be unit tested (tests/test_router_protocol.py).

Unknown request fields are ignored, as vLLM and SGLang do, so clients that send extensions
(`ignore_eos`, `stop_token_ids`) or fields we do not use (`user`) keep working; fields we would
have to ignore *silently* in a way that changes the answer (`n` > 1, penalties, `best_of`,
`suffix`) are refused with a 400 instead. Log probabilities (completions `logprobs` + `echo`, chat
`logprobs` + `top_logprobs`) are served; router/openai/logprobs_format.py shapes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.checkpoint.tokenizer import Tokenizer
from engine.sequence import SamplingParams
from router.openai.body import MAX_JSON_DEPTH as MAX_JSON_DEPTH
from router.openai.body import OpenAIError as OpenAIError
from router.openai.body import bad as bad
from router.openai.body import error_body as error_body
from router.openai.body import parse_json as parse_json
from router.openai.chat_prompt import ChatMessage as ChatMessage
from router.openai.chat_prompt import chat_prompt_ids as chat_prompt_ids
from router.openai.chat_prompt import message_text as message_text
from router.openai.chat_prompt import render_chat as render_chat

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM and the OpenAI chat API allow
INT64 = 1 << 63


# ------------------------------------------------------------------------------ request models
class _Strict(BaseModel):
    # strict: "5" is not an int and 1.5 is not an int (wrong types are 400s, not guesses)
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None  # optional: defaults to the one served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str]; checked by hand for a clearer message
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False  # vLLM extension (benchmarks keep output lengths exact with it)
    stop_token_ids: list[int] | None = None  # vLLM extension
    # pdserve extension: how this request's KV crosses to the decode pool (default: the server's
    # --kv-transfer); lets one server compare bulk and layer-wise on the same workers
    kv_transfer: Literal["bulk", "layerwise", "auto"] | None = None


class CompletionRequest(_Common):
    prompt: Any  # str | list[int] | [str] | [list[int]]; checked by hand
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# ------------------------------------------------------------------------------ validation
@dataclass(frozen=True)
class Limits:
    """What the served model allows; built by the app from the orchestrator and ServeConfig."""

    model_name: str  # the name echoed in responses
    accepted_names: frozenset[str]
    context_len: int  # prompt + max_tokens must fit
    vocab_size: int
    max_tokens_limit: int


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the orchestrator."""

    kind: Literal["completion", "chat"]
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # top alternatives per generated token; None = no logprobs
    echo: bool = False  # completions: the prompt (and its logprobs, with logprobs) come first
    prompt_text: str = ""  # what echo prepends
    kv_transfer: str | None = None  # the request's own --kv-transfer (None: the server's)


def _model_validate(cls: type[_Strict], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.", code="invalid_json")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = "field required" if err["type"] == "missing" else err["msg"]
        raise bad(
            f"Invalid value for '{param}': {msg}.",
            param=param,
            code="invalid_type" if err["type"] != "missing" else "missing_required_parameter",
        ) from None


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def completion_prompt_ids(prompt: Any, tok: Tokenizer) -> list[int]:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad(
                f"Batched prompts are not supported ({len(prompt)} given); send one prompt per request.", param="prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if _is_ids(prompt):
        return list(prompt)
    raise bad("'prompt' must be a string, a list of token ids, or a list holding one of those.", param="prompt")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not (isinstance(items, list) and all(isinstance(s, str) for s in items)):
        raise bad("'stop' must be a string or a list of strings.", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad(f"At most {MAX_STOP_STRINGS} stop strings are supported ({len(items)} given).", param="stop")
    if any(s == "" for s in items):
        raise bad("Stop strings must not be empty.", param="stop")
    return tuple(dict.fromkeys(items))


def _check_unsupported(req: _Common) -> None:
    if req.n is not None and req.n != 1:
        raise bad(f"Only n=1 is supported (got n={req.n}).", param="n", code="unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise bad(f"'{name}' is not supported; omit it or send 0.", param=name, code="unsupported_parameter")
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be between 0 and {MAX_LOGPROBS} (got {req.logprobs}).", param="logprobs")
        if req.best_of not in (None, 1):
            raise bad("Only best_of=1 is supported.", param="best_of", code="unsupported_value")
        if req.suffix:
            raise bad("'suffix' is not supported.", param="suffix", code="unsupported_parameter")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None:
        if not req.logprobs:
            raise bad("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad(
                f"'top_logprobs' must be between 0 and {MAX_LOGPROBS} (got {req.top_logprobs}).", param="top_logprobs"
            )


def _sampling(
    req: _Common, max_tokens: int | None, prompt_len: int, lim: Limits, default_max: int | None, max_param: str
) -> SamplingParams:
    room = lim.context_len - prompt_len
    if room < 1:
        raise bad(
            f"This model's maximum context length is {lim.context_len} tokens; the prompt has "
            f"{prompt_len} tokens, which leaves no room to generate.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max or room, room, lim.max_tokens_limit)
    if max_tokens < 1:
        raise bad(f"'{max_param}' must be at least 1 (got {max_tokens}).", param=max_param)
    if max_tokens > lim.max_tokens_limit:
        raise bad(
            f"'{max_param}' must be at most {lim.max_tokens_limit} on this server (got {max_tokens}).", param=max_param
        )
    if prompt_len + max_tokens > lim.context_len:
        raise bad(
            f"This model's maximum context length is {lim.context_len} tokens; you requested "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion).",
            param=max_param,
            code="context_length_exceeded",
        )
    t = 1.0 if req.temperature is None else req.temperature
    if not (math.isfinite(t) and 0 <= t <= 2):
        raise bad(f"'temperature' must be between 0 and 2 (got {t}).", param="temperature")
    p = 1.0 if req.top_p is None else req.top_p
    if not (math.isfinite(p) and 0 < p <= 1):
        raise bad(f"'top_p' must be greater than 0 and at most 1 (got {p}).", param="top_p")
    if req.seed is not None and not -INT64 <= req.seed < INT64:
        raise bad("'seed' must fit in a signed 64-bit integer.", param="seed")
    stop_ids = tuple(req.stop_token_ids or ())
    if any(not 0 <= i < lim.vocab_size for i in stop_ids):
        raise bad(f"'stop_token_ids' must be in [0, {lim.vocab_size}).", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens, temperature=t, top_p=p, seed=req.seed, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos
    )


def _prepare(
    kind: Literal["completion", "chat"],
    req: _Common,
    ids: list[int],
    max_tokens: int | None,
    max_param: str,
    lim: Limits,
    stop_ids: tuple[int, ...] = (),
) -> Prepared:
    """stop_ids: token ids that end generation besides the request's own (a chat's end of turn)."""
    if req.model is not None and req.model not in lim.accepted_names:
        raise OpenAIError(
            404,
            f"The model '{req.model}' does not exist; this server serves '{lim.model_name}'.",
            param="model",
            code="model_not_found",
        )
    _check_unsupported(req)
    stop = _stop_strings(req.stop)
    if req.stream_options is not None and not req.stream:
        raise bad("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    if not ids:
        raise bad("The prompt is empty.", param="prompt" if kind == "completion" else "messages")
    bad_ids = [i for i in ids if not 0 <= i < lim.vocab_size]
    if bad_ids:
        raise bad(f"Token ids must be in [0, {lim.vocab_size}) (bad: {bad_ids[:5]}).", param="prompt")
    # OpenAI's defaults: 16 tokens for completions, "as many as fit" for chat.
    default_max = 16 if kind == "completion" else None
    params = _sampling(req, max_tokens, len(ids), lim, default_max, max_param)
    if stop_ids:
        params = replace(params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + stop_ids)))
    if isinstance(req, ChatCompletionRequest):
        logprobs, echo = ((req.top_logprobs or 0) if req.logprobs else None), False
    else:
        logprobs, echo = req.logprobs, bool(req.echo)  # type: ignore[attr-defined]
    params = replace(params, logprobs=logprobs, prompt_logprobs=logprobs if echo else None)
    return Prepared(
        kind,
        lim.model_name,
        ids,
        params,
        stop,
        bool(req.stream),
        bool(req.stream and req.stream_options and req.stream_options.include_usage),
        logprobs=logprobs,
        echo=echo,
        kv_transfer=req.kv_transfer,
    )


def prepare_completion(body: Any, tok: Tokenizer, lim: Limits) -> Prepared:
    req: CompletionRequest = _model_validate(CompletionRequest, body)
    ids = completion_prompt_ids(req.prompt, tok)
    p = _prepare("completion", req, ids, req.max_tokens, "max_tokens", lim)
    if p.echo:
        text = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and not _is_ids(req.prompt) else req.prompt
        p = replace(p, prompt_text=text if isinstance(text, str) else tok.decode(ids))
    return p


def prepare_chat(body: Any, tok: Tokenizer, lim: Limits) -> Prepared:
    req: ChatCompletionRequest = _model_validate(ChatCompletionRequest, body)
    if not req.messages:
        raise bad("'messages' must hold at least one message.", param="messages")
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise bad("'max_tokens' and 'max_completion_tokens' disagree; send one.", param="max_completion_tokens")
    mt, param = (
        (req.max_completion_tokens, "max_completion_tokens")
        if req.max_completion_tokens is not None
        else (req.max_tokens, "max_tokens")
    )
    ids = chat_prompt_ids(req.messages, tok)
    return _prepare("chat", req, ids, mt, param, lim, stop_ids=tuple(getattr(tok, "end_of_turn_ids", ())))
