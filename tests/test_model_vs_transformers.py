"""The engine's Llama against transformers' LlamaForCausalLM on the same saved checkpoint.

Checkpoints come from tests/conftest.py: llama3 rope scaling with all three frequency bands
populated, grouped-query attention, random norm weights, one with untied and one with tied
embeddings, saved by `save_pretrained` as safetensors and read back by our loader.

Full-sequence logits are compared two ways: (A) one batched prefill whose items are every
prefix of the sequence (item j's last-token logits are position j's), and (B) a prompt prefill
followed by teacher-forced decode steps over paged KV, which is how the engine generates.
"""

from __future__ import annotations

import json

import pytest
import torch

from cli import main as cli_main
from engine.config import CacheConfig, resolve_model_config
from engine.core.llm_engine import LLMEngine
from engine.kv.block_manager import BlockManager
from engine.model.linear import Fp8Linear
from engine.runner.model_runner import ModelRunner, StepItem
from engine.sequence import SamplingParams, Sequence
from tests.helpers import run_to_completion

KINDS = ("untied", "tied")
PROMPT_LEN, NEW_TOKENS = 12, 16
FP32_TOL = 1e-4  # max |ours - HF| / std(HF logits); measured ~2e-6 on the 2-core CPU
# FP8 e4m3 weights (per-output-channel scales) + FP8 KV (per-token-head scales) against fp32 HF.
# Measured over 28 positions x 300 logits, 6 prompts, both checkpoints (2-core CPU, torch 2.13):
# max |err|/std 0.18..0.34, rms err/std 0.045..0.080. Tolerances leave ~2x headroom.
FP8_MAX_TOL, FP8_RMS_TOL = 0.6, 0.15


def _prompt(seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()  # 0..2 are pad/bos/eos


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation and the per-step top-2 margin in units of the logits' std."""
    out = hf.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    logits = torch.stack(out.logits)[:, 0]
    top2 = logits.topk(2, dim=-1).values
    return out.sequences[0, len(prompt) :].tolist(), (top2[:, 0] - top2[:, 1]) / logits.std()


def _clear_prompts(hf, vocab: int, n: int, min_margin: float) -> list[tuple[list[int], list[int]]]:
    """The first n seeded prompts whose HF greedy run never has a top-2 margin below
    `min_margin` std: greedy equality on them tests real decisions, not rounding noise."""
    found = []
    for seed in range(60):
        prompt = _prompt(seed, vocab)
        new, margins = _hf_greedy(hf, prompt)
        if margins.min() >= min_margin:
            found.append((prompt, new))
            if len(found) == n:
                return found
    raise AssertionError(f"fewer than {n} of 60 prompts have greedy margins >= {min_margin} std")


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _runner(ckpt, weight_dtype: str, kv_dtype: str, num_blocks: int = 128) -> ModelRunner:
    cfg = resolve_model_config(str(ckpt.path))
    return ModelRunner(
        cfg,
        CacheConfig(block_size=4, num_blocks=num_blocks, kv_dtype=kv_dtype),
        weight_dtype,
        checkpoint_dir=str(ckpt.path),
    )


def _all_prefixes_batched(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Path A: one forward whose items are ids[:1], ids[:2], ... -> logits of every position."""
    bm = BlockManager(runner.cache_cfg.num_blocks, runner.cache_cfg.block_size)
    items = [StepItem(ids[:j], 0, bm.allocate(bm.blocks_for(j))) for j in range(1, len(ids) + 1)]
    return runner.forward(items)


def _prefill_then_decode(runner: ModelRunner, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Path B: prefill ids[:prompt_len], then feed the rest one token at a time (teacher
    forcing) -> logits of positions prompt_len-1 .. len(ids)-1. The block table is deliberately
    non-contiguous and out of order."""
    bs = runner.cache_cfg.block_size
    table = [9, 3, 17, 0, 12, 5, 30, 21][: -(-len(ids) // bs)]
    rows = [runner.forward([StepItem(ids[:prompt_len], 0, table)])[0]]
    for p in range(prompt_len, len(ids)):
        rows.append(runner.forward([StepItem([ids[p]], p, table)])[0])
    return torch.stack(rows)


def test_config_json_round_trip(hf_checkpoints):
    """Our reading of transformers' config.json (incl. its rope_parameters) is the config we wrote."""
    for ckpt in hf_checkpoints.values():
        got = resolve_model_config(str(ckpt.path))
        assert {**got.to_dict(), "name": None} == {**ckpt.cfg.to_dict(), "name": None}


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_logits_match_transformers(kind, hf_checkpoints, hf_models):
    hf, ckpt = hf_models[kind], hf_checkpoints[kind]
    prompt = _prompt(7, ckpt.cfg.vocab_size)
    new, _ = _hf_greedy(hf, prompt)
    ids = prompt + new
    ref = _hf_logits(hf, ids)
    scale = ref.std().item()
    runner = _runner(ckpt, "fp32", "fp32")
    batched = _all_prefixes_batched(runner, ids)
    decoded = _prefill_then_decode(_runner(ckpt, "fp32", "fp32"), ids, PROMPT_LEN)
    assert batched.shape == ref.shape
    assert (batched - ref).abs().max().item() <= FP32_TOL * scale
    assert (decoded - ref[PROMPT_LEN - 1 :]).abs().max().item() <= FP32_TOL * scale
    assert decoded.argmax(-1)[:-1].tolist() == new


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_logits_within_stated_tolerance(kind, hf_checkpoints, hf_models):
    hf, ckpt = hf_models[kind], hf_checkpoints[kind]
    runner = _runner(ckpt, "fp8", "fp8")
    assert runner.cache.is_fp8 and isinstance(runner.model.layers[0].mlp.down_proj, Fp8Linear)
    for seed in (0, 1, 2):
        prompt = _prompt(seed, ckpt.cfg.vocab_size)
        ids = prompt + _hf_greedy(hf, prompt)[0]
        ref = _hf_logits(hf, ids)[PROMPT_LEN - 1 :]
        err = _prefill_then_decode(runner, ids, PROMPT_LEN) - ref
        scale = ref.std().item()
        max_rel, rms_rel = err.abs().max().item() / scale, err.pow(2).mean().sqrt().item() / scale
        print(f"fp8 vs HF fp32 [{kind}, prompt {seed}]: max|err|/std={max_rel:.3f} rms/std={rms_rel:.3f}")
        assert max_rel <= FP8_MAX_TOL and rms_rel <= FP8_RMS_TOL
        # ...and FP8 is not secretly running the fp32 path: the error is that of e4m3.
        assert max_rel > 1e-3


def _engine_greedy(runner: ModelRunner, prompts: list[list[int]], chunk_size: int | None = None) -> list[list[int]]:
    """Greedy generation of NEW_TOKENS for all prompts at once through the continuous-batching engine."""
    engine = LLMEngine(runner, chunk_size=chunk_size)
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)) for i, p in enumerate(prompts)]
    return run_to_completion(engine, seqs)


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_engine_greedy_equals_hf_generate(kind, hf_checkpoints, hf_models):
    hf, ckpt = hf_models[kind], hf_checkpoints[kind]
    # margins >= 1e-3 std are ~500x the measured fp32 error, so any difference is a real bug
    cases = _clear_prompts(hf, ckpt.cfg.vocab_size, 3, min_margin=1e-3)
    got = _engine_greedy(_runner(ckpt, "fp32", "fp32"), [p for p, _ in cases], chunk_size=5)
    assert got == [new for _, new in cases]


def test_fp8_engine_greedy_agrees_with_hf(hf_checkpoints, hf_models):
    """FP8 weights + FP8 KV generate HF's fp32 greedy tokens whenever HF's decisions are clear.
    Clear = every step's top-2 margin is >= 0.8 std, above twice the worst FP8 logit error
    measured (0.34 std). The tied checkpoint is used: a random untied head almost never keeps
    such margins for 16 steps (min margin over 40 prompts was <= 0.07 std), while tied
    embeddings favour repeating tokens confidently."""
    hf, ckpt = hf_models["tied"], hf_checkpoints["tied"]
    cases = _clear_prompts(hf, ckpt.cfg.vocab_size, 3, min_margin=0.8)
    got = _engine_greedy(_runner(ckpt, "fp8", "fp8"), [p for p, _ in cases])
    assert got == [new for _, new in cases]


def test_cli_fp32_greedy_equals_hf_generate(hf_checkpoints, hf_models, capsys):
    """The issue's "Done when": `pdserve generate --model DIR --dtype fp32 --json` == HF greedy."""
    hf, ckpt = hf_models["untied"], hf_checkpoints["untied"]
    prompt, new = _clear_prompts(hf, ckpt.cfg.vocab_size, 1, min_margin=1e-3)[0]
    rc = cli_main(
        [
            "generate",
            "--model",
            str(ckpt.path),
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            str(NEW_TOKENS),
            "--temperature",
            "0",
            "--dtype",
            "fp32",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["token_ids"] == new and out["kv_dtype"] == "fp32" and out["prompt_tokens"] == PROMPT_LEN
