"""Chat templates and streaming text with the real model's tokenizer.

The reference is transformers' own `apply_chat_template` on the same GGUF's tokenizer and
template: the prompt ids pdserve sends to the model must be exactly the ones transformers would.
"""

from __future__ import annotations

import pytest

from engine.checkpoint.chat_template import ChatTemplate, ChatTemplateError
from engine.checkpoint.tokenizer import Detokenizer, load_tokenizer
from engine.config import resolve_model_config
from router.openai import protocol as oa

# the real 135M model, often beside transformers: tens of seconds on 2 cores
pytestmark = [pytest.mark.real_model]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain? Ünïcödé 日本 🎉"},
    ],
]


@pytest.fixture(scope="module")
def tok(smollm2):
    cfg = resolve_model_config(str(smollm2))
    return load_tokenizer(str(smollm2), cfg.bos_token_id, cfg.eos_token_id)


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_prompt_ids_equal_transformers(smollm2_hf_tokenizer, tok, i):
    hf = smollm2_hf_tokenizer
    msgs = CONVERSATIONS[i]
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    ours = oa.chat_prompt_ids([oa.ChatMessage(**m) for m in msgs], tok)
    assert ours == list(ref)
    assert tok.decode(ours).endswith("assistant\n")


def test_end_of_turn_is_a_stop_token(tok, smollm2):
    assert tok.chat_template is not None
    assert tok.end_of_turn_ids == (tok.token_id("<|im_end|>"),)
    lim = oa.Limits("m", frozenset({"m"}), 8192, 49152, 4096)
    p = oa.prepare_chat({"messages": [{"role": "user", "content": "hi"}]}, tok, lim)
    assert tok.token_id("<|im_end|>") in p.params.stop_token_ids


def test_template_errors_are_400():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first must be user"):
        t.render([{"role": "assistant", "content": "x"}])

    class Tok:
        chat_template = t
        end_of_turn_ids = ()

        def encode(self, text, add_bos=True):
            return [1]

    with pytest.raises(oa.OpenAIError) as e:
        oa.chat_prompt_ids([oa.ChatMessage(role="assistant", content="x")], Tok())
    assert e.value.status == 400 and "first must be user" in e.value.message


def test_streaming_detokenization_of_split_multibyte_characters(tok):
    """Byte-level BPE splits emoji and CJK characters across tokens: the stream must never emit
    a half character (U+FFFD) and must add up to the full decode."""
    text = "Ünïcödé: 日本語のテキスト, emoji 🎉🚀👩‍👩‍👧, math ∑∫√, done."
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens really are partial characters
    d = Detokenizer(tok)
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
