"""`pdserve generate`: one prompt through the local engine (no Ray, no server)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Protocol

from cli import CliError
from cli.output import emit_json
from engine.checkpoint.chat_template import ChatTemplateError
from engine.checkpoint.registry import DEFAULT_MODEL, MODELS, PullError
from engine.checkpoint.registry import resolve as resolve_model
from engine.checkpoint.tokenizer import load_tokenizer
from engine.config import PRESETS, CacheConfig, is_checkpoint_dir, read_generation_eos, resolve_model_config
from engine.core.llm_engine import LLMEngine
from engine.gguf_file import GGUFError
from engine.runner.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence


class FlagTarget(Protocol):
    """A parser or one of its argument groups: what flags are added to."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> Any: ...


def add_dtype_arguments(p: FlagTarget, kv_help: str) -> None:
    """--dtype and --kv-dtype, as `generate` and the engine benchmarks take them (kv_dtype_of reads them)."""
    p.add_argument("--dtype", choices=["fp8", "bf16", "fp32"], default="fp8", help="weight dtype (default fp8)")
    p.add_argument("--kv-dtype", choices=["fp8", "bf16", "fp32"], default=None, help=kv_help)


def kv_dtype_of(args: argparse.Namespace) -> str:
    """--kv-dtype, or its default: FP8 KV, but fp32 beside fp32 weights."""
    return str(args.kv_dtype or ("fp32" if args.dtype == "fp32" else "fp8"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a registry model ({', '.join(MODELS)}; pulled on first use), a preset ({', '.join(PRESETS)}; "
        f"random weights), a Hugging Face Llama checkpoint directory or a .gguf file "
        f"(default {DEFAULT_MODEL})",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument(
        "--raw",
        action="store_true",
        help="send --prompt as plain text (default: as one user message through the model's own chat "
        "template, if it has one)",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (temperature > 0)")
    add_dtype_arguments(p, kv_help="KV cache dtype (default: fp8, or fp32 with --dtype fp32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill in chunks of N tokens")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying a captured CUDA graph",
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _parse_ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if not ids or bad:
        raise CliError(f"--prompt-ids: ids must be in [0, {vocab}) and at least one is required (bad: {bad[:5]})")
    return ids


def main(args: argparse.Namespace) -> int:
    try:
        args.model = resolve_model(args.model)
    except PullError as e:
        raise CliError(str(e)) from None
    if args.model not in PRESETS and not is_checkpoint_dir(args.model):
        raise CliError(
            f"--model {args.model!r}: not a preset ({', '.join(PRESETS)}), a registry model "
            f"({', '.join(MODELS)}), a directory containing config.json or a .gguf file"
        )
    if args.max_tokens < 1:
        raise CliError("--max-tokens must be >= 1")
    if args.chunk_size is not None and args.chunk_size < 1:
        raise CliError("--chunk-size must be >= 1")
    if args.device == "cuda":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise CliError("--device cuda: no CUDA device is available")
    try:
        cfg = resolve_model_config(args.model)
    except GGUFError as e:
        raise CliError(str(e)) from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable or non-Llama config.json
        raise CliError(f"--model {args.model!r}: cannot read config.json: {e!r}") from None
    ckpt = args.model if args.model not in PRESETS else None
    tok = load_tokenizer(args.model, cfg.bos_token_id, cfg.eos_token_id)
    template = None if args.raw or args.prompt_ids else tok.chat_template
    chat = template is not None
    if args.prompt_ids:
        ids = _parse_ids(args.prompt_ids, cfg.vocab_size)
    elif template is not None and args.prompt:
        try:
            ids = tok.encode(template.render([{"role": "user", "content": args.prompt}]), add_bos=False)
        except ChatTemplateError as e:
            raise CliError(str(e)) from None
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise CliError("--prompt is empty")
    total = len(ids) + args.max_tokens
    if total > cfg.max_position_embeddings:
        raise CliError(
            f"prompt ({len(ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the model's "
            f"context of {cfg.max_position_embeddings} tokens"
        )
    kv_dtype = kv_dtype_of(args)
    block = 16
    # one spare block: the CUDA graphs' padding scratch block
    cache = CacheConfig(block_size=block, num_blocks=-(-total // block) + 2, kv_dtype=kv_dtype)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            stop_token_ids=tok.end_of_turn_ids if chat else (),
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    t_load = time.perf_counter()
    try:
        runner = ModelRunner(cfg, cache, args.dtype, args.device, ckpt)
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # missing/incomplete/mis-shaped weights
        raise CliError(f"--model {args.model!r}: cannot load weights: {e}") from None
    load_s = time.perf_counter() - t_load
    eos = tuple(read_generation_eos(args.model)) if ckpt else ()
    engine = LLMEngine(runner, chunk_size=args.chunk_size, eos_ids=eos, max_num_seqs=1)
    if args.device == "cuda" and not args.enforce_eager:
        from engine.gpu.cuda_graphs import attach_decode_graphs  # noqa: PLC0415 (CUDA only: needs triton)

        attach_decode_graphs(engine)
    seq = Sequence("generate", ids, params)
    engine.add_request(seq)
    t0 = time.perf_counter()
    engine.step()  # prefill (all chunks) ends when the first token is sampled
    while not seq.output_ids:
        engine.step()
    t_first = time.perf_counter()
    while engine.has_work:
        engine.step()
    t_end = time.perf_counter()
    n_decode = len(seq.output_ids) - 1
    result = {
        "model": cfg.name,
        "dtype": args.dtype,
        "kv_dtype": kv_dtype,
        "device": args.device,
        "chat_template": chat,
        "prompt_tokens": len(ids),
        "token_ids": seq.output_ids,
        "text": tok.decode(seq.output_ids),
        "finish_reason": seq.finish_reason,
        "timings": {
            "load_s": round(load_s, 4),
            "prefill_ms": round((t_first - t0) * 1e3, 3),
            "decode_tokens_per_s": round(n_decode / (t_end - t_first), 2) if n_decode else None,
        },
    }
    if args.json:
        emit_json(result, indent=None)
    else:
        print(result["text"])
        t = result["timings"]
        print(
            f"\n[{cfg.name} {args.dtype} on {args.device}] prompt {len(ids)} tok, generated {len(seq.output_ids)} "
            f"tok ({seq.finish_reason}); prefill {t['prefill_ms']} ms, decode {t['decode_tokens_per_s']} tok/s"
        )
    return 0


__all__ = ["FlagTarget", "add_arguments", "add_dtype_arguments", "kv_dtype_of", "main"]
