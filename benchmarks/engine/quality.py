"""`pdserve bench quality`: what FP8 costs a real model, measured on a text shipped in the repo.

For the real model (default: SmolLM2-135M-Instruct) and the first `--tokens` tokens of
benchmarks/data/article.md (the article pdserve grew from), one teacher-forced prefill per
precision setting through pdserve's own engine (paged KV pool included: attention reads K/V
back from the pool, so the KV dtype matters), giving:

- perplexity: exp(mean negative log-likelihood of tokens 2..N), from the engine's prompt logprobs;
- greedy agreement: the share of positions whose most likely next token equals transformers' fp32;

beside transformers' own fp32 perplexity on the same token ids (transformers reads the same GGUF
with its own dequantizer). One JSON result with provenance and one printed table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from cli import CliError
from costmodel.provenance import OUT_DIR_HELP

TEXT = Path(__file__).resolve().parents[1] / "data" / "article.md"
# name -> (weight dtype, kv dtype)
SETTINGS = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "fp8-weights": ("fp8", "fp32"),
    "fp8-kv": ("fp32", "fp8"),
    "fp8": ("fp8", "fp8"),  # what `pdserve serve` runs by default
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.checkpoint.registry import DEFAULT_MODEL  # noqa: PLC0415

    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registry model, checkpoint directory or .gguf file (default {DEFAULT_MODEL})",
    )
    p.add_argument("--tokens", type=int, default=1024, help="score the first N tokens of the text (default 1024)")
    p.add_argument("--text", default=str(TEXT), help="text file to score (default: the article shipped in the repo)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers fp32 reference")
    p.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma-separated subset of {','.join(SETTINGS)} (weights/KV: fp32/fp32, bf16/bf16, fp8/fp32, "
        "fp32/fp8, fp8/fp8; the first is the baseline of the 'vs' column)",
    )
    p.add_argument("--out", default=None, help="result name (default quality-<model>-cpu)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--json", action="store_true", help="print the result as one JSON document instead of the table")


def _engine_scores(model: str, ids: list[int], weights: str, kv: str) -> tuple[list[float], list[int], float]:
    """(logprob of each token 2..N, most likely id at each position 1..N-1, seconds)."""
    from engine.config import CacheConfig, resolve_model_config  # noqa: PLC0415
    from engine.core.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415

    cfg = resolve_model_config(model)
    cache = CacheConfig(block_size=16, num_blocks=-(-(len(ids) + 1) // 16) + 1, kv_dtype=kv)
    engine = LLMEngine(ModelRunner(cfg, cache, weights, "cpu", model), max_prefill_tokens=len(ids))
    seq = Sequence("quality", ids, SamplingParams(max_tokens=1, prompt_logprobs=1))
    engine.add_request(seq)
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - t0
    entries = [e for e in seq.prompt_logprobs[1:] if e is not None]
    return [e.logprob for e in entries], [e.top[0][0] for e in entries], seconds


def _transformers_scores(model: str, ids: list[int]) -> tuple[list[float], list[int]]:
    import tempfile  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    gguf = next(Path(model).glob("*.gguf"), None) if Path(model).is_dir() else Path(model)
    with tempfile.TemporaryDirectory() as d:
        if gguf is not None and gguf.suffix == ".gguf":  # only the GGUF: transformers reads it, not our files
            (Path(d) / gguf.name).symlink_to(gguf.resolve())
            hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf.name, dtype=torch.float32)
        else:
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf.eval()(torch.tensor([ids])).logits[0].float(), dim=-1)  # [N, V]
    target = torch.tensor(ids[1:])
    return logp[:-1].gather(1, target[:, None]).squeeze(1).tolist(), logp[:-1].argmax(-1).tolist()


def _ppl(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.checkpoint.registry import PullError  # noqa: PLC0415
    from engine.checkpoint.registry import resolve as registry_resolve  # noqa: PLC0415
    from engine.checkpoint.tokenizer import ByteTokenizer, load_tokenizer  # noqa: PLC0415
    from engine.config import resolve_model_config  # noqa: PLC0415

    try:
        model = registry_resolve(args.model, progress=not args.json)
    except PullError as e:
        raise CliError(str(e)) from None
    try:
        cfg = resolve_model_config(model)
    except (OSError, ValueError) as e:
        raise CliError(f"--model {args.model!r}: {e}") from None
    tok = load_tokenizer(model, cfg.bos_token_id, cfg.eos_token_id)
    if isinstance(tok, ByteTokenizer):
        raise CliError(
            f"--model {args.model!r}: bench quality needs a real checkpoint (random presets have no quality)"
        )
    try:
        text = Path(args.text).read_text()
    except OSError as e:
        raise CliError(f"--text {args.text}: {e.strerror or e}") from None
    ids = tok.encode(text)[: args.tokens]
    if len(ids) < 2 or args.tokens < 2:
        raise CliError(f"--tokens {args.tokens}: need at least 2 tokens (the text has {len(tok.encode(text))})")
    ref_lp, ref_top = (None, None) if args.no_transformers else _transformers_scores(model, ids)
    rows = []
    for label in args.settings.split(","):
        weights, kv = SETTINGS[label]
        lp, top, seconds = _engine_scores(model, ids, weights, kv)
        rows.append(
            {
                "setting": label,
                "weights": weights,
                "kv": kv,
                "perplexity": round(_ppl(lp), 4),
                "nll": round(-sum(lp) / len(lp), 5),
                "seconds": round(seconds, 3),
                "greedy_agreement": None
                if ref_top is None
                else round(sum(a == b for a, b in zip(top, ref_top)) / len(top), 4),
            }
        )
    base = rows[0]["perplexity"]
    for r in rows:
        r["vs_first_pct"] = round(100 * (r["perplexity"] - base) / base, 2)
    return {
        "model": args.model,
        "model_path": model,
        "text": Path(args.text).name,
        "tokens": len(ids),
        "transformers_fp32_perplexity": None if ref_lp is None else round(_ppl(ref_lp), 4),
        "settings": rows,
        "note": "teacher-forced whole-prompt prefill through pdserve's engine on CPU; perplexity over tokens "
        "2..N; greedy agreement = share of positions whose argmax equals transformers' fp32 argmax",
    }


def table(res: dict[str, Any]) -> str:
    lines = [
        f"bench quality: {res['model']} on the first {res['tokens']} tokens of {res['text']}",
        f"{'setting':<18} {'weights':>7} {'kv':>5} {'perplexity':>11} {'vs first':>8} {'agree w/ HF':>11}",
    ]
    for r in res["settings"]:
        agree = "-" if r["greedy_agreement"] is None else f"{100 * r['greedy_agreement']:.1f}%"
        lines.append(
            f"{r['setting']:<18} {r['weights']:>7} {r['kv']:>5} {r['perplexity']:>11.3f} "
            f"{r['vs_first_pct']:>+7.2f}% {agree:>11}"
        )
    if res["transformers_fp32_perplexity"] is not None:
        lines.append(f"{'transformers fp32':<18} {'fp32':>7} {'-':>5} {res['transformers_fp32_perplexity']:>11.3f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from cli.output import emit_json  # noqa: PLC0415 - the CLI layer, only for this command's output
    from costmodel.provenance import write_result  # noqa: PLC0415

    if args.tokens < 2:
        raise CliError("--tokens must be >= 2")
    bad = [x for x in args.settings.split(",") if x not in SETTINGS]
    if bad:
        raise CliError(f"--settings: unknown {bad}; choose from {','.join(SETTINGS)}")
    res = run(args)
    name = args.out or f"quality-{Path(res['model_path']).name}-cpu"
    path = write_result(name, res, config=vars_config(args), out_dir=Path(args.out_dir) if args.out_dir else None)
    if args.json:
        emit_json({**json.loads(path.read_text()), "result": str(path)})
    else:
        print(table(res))
        print(f"result: {path}")
    return 0


def vars_config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("command", "bench_command")}


__all__ = ["add_arguments", "main", "run", "table"]
