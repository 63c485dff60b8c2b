"""`pdserve bench kvcache`: what the KV cache manager buys, measured.

Two parts (`--part capacity|multiturn|both`):

- capacity (in this process, one engine, the tiny model): the same stream of requests
  (`max_tokens` 1024, outputs drawn in 100-300 tokens: the request ends there, as at an EOS) on
  the same pool, blocks given on demand vs prompt + max_tokens reserved at admission. Reported:
  concurrent running sequences (mean and peak over steps), preemptions, steps to finish.
- multiturn (real servers: Ray, NIXL, uvicorn, the openai client): 2P2D disaggregated, chats that
  share a system prompt and grow turn by turn (each turn's prompt = the previous prompt + its
  reply + a new user message, sent as token ids). Run twice on fresh servers: prefix caching off
  with round_robin routing, then caching on with `--policy prefix`. Reported per run: TTFT by turn
  (server side: arrival to first token, from the request timeline), KV bytes pulled per request,
  prefix hit rate on each side.

Writes one JSON with provenance (benchmarks/results/local/ by default) and prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.output import emit_json
from costmodel.provenance import OUT_DIR_HELP, write_result


# ----------------------------------------------------------------------------- capacity
@dataclass(frozen=True)
class CapacityConfig:
    num_blocks: int = 512
    block_size: int = 16
    requests: int = 96
    prompt_len: int = 64
    max_tokens: int = 1024
    output_min: int = 100
    output_max: int = 300
    max_num_seqs: int = 256
    seed: int = 0


def run_capacity(cfg: CapacityConfig, reserve: bool) -> dict[str, Any]:
    from engine.config import PRESETS, CacheConfig  # noqa: PLC0415 - torch only when this part runs
    from engine.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.model_runner import ModelRunner  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415

    rng = random.Random(cfg.seed)
    runner = ModelRunner(
        PRESETS["tiny"], CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks, kv_dtype="fp8"), "fp8"
    )
    engine = LLMEngine(runner, max_num_seqs=cfg.max_num_seqs, reserve_budget=reserve, enable_prefix_caching=False)
    target: dict[str, int] = {}
    for i in range(cfg.requests):
        prompt = [rng.randrange(32, 127) for _ in range(cfg.prompt_len)]
        seq = Sequence(f"c{i}", prompt, SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True))
        target[seq.seq_id] = rng.randint(cfg.output_min, cfg.output_max)
        engine.add_request(seq)
    running, steps, t0 = [], 0, time.perf_counter()
    while engine.has_work:
        events = engine.step()
        steps += 1
        running.append(len(engine.running))
        for ev in events:  # the drawn output length plays the part of an EOS
            if not ev.finished and ev.index + 1 >= target[ev.seq_id]:
                engine.abort(ev.seq_id)
        engine.blocks.check() if steps % 64 == 0 else None
    assert engine.blocks.check().in_use == 0
    busy = [r for r in running if r]
    return {
        "policy": "reserved" if reserve else "on_demand",
        "mean_running": statistics.fmean(busy),
        "peak_running": max(running),
        "preemptions": engine.preemptions,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }


# ----------------------------------------------------------------------------- multi-turn
@dataclass(frozen=True)
class MultiTurnConfig:
    conversations: int = 8
    turns: int = 4
    system_len: int = 384
    user_len: int = 32
    output_len: int = 32
    prefill: int = 2
    decode: int = 2
    num_blocks: int = 1024
    seed: int = 0


async def _conversation(client: Any, cfg: MultiTurnConfig, system: list[int], rng: random.Random) -> list[dict]:
    prompt, out = list(system), []
    for turn in range(cfg.turns):
        prompt += [rng.randrange(32, 127) for _ in range(cfg.user_len)]
        resp = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=cfg.output_len,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        tl = resp.model_extra["pdserve"]["timeline"]
        out.append({"turn": turn + 1, **{k: tl.get(k) for k in _TL_KEYS}, "bytes": tl["transfer"]["bytes"]})
        prompt += tl["token_ids"]
    return out


_TL_KEYS = ("prompt_tokens", "first_token_ms", "prefill_cached_tokens", "decode_cached_tokens", "kv_blocks_pulled")


def run_multiturn(cfg: MultiTurnConfig, caching: bool, policy: str) -> dict[str, Any]:
    from openai import AsyncOpenAI  # noqa: PLC0415

    from router.config import ServeConfig  # noqa: PLC0415
    from router.serve_cli import ServerThread  # noqa: PLC0415

    serve = ServeConfig(
        mode="disagg",
        model="tiny",
        prefill=cfg.prefill,
        decode=cfg.decode,
        policy=policy,
        prefix_cache=caching,
        num_blocks=cfg.num_blocks,
        port=0,
    )
    rng = random.Random(cfg.seed)
    system = [rng.randrange(32, 127) for _ in range(cfg.system_len)]
    seeds = [rng.random() for _ in range(cfg.conversations)]
    with ServerThread(serve, startup_timeout_s=300) as srv:

        async def main() -> list[list[dict]]:
            client = AsyncOpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=300)
            return await asyncio.gather(*(_conversation(client, cfg, system, random.Random(s)) for s in seeds))

        convs = asyncio.run(main())
    rows = [r for c in convs for r in c]
    by_turn = {}
    for t in range(1, cfg.turns + 1):
        rs = [r for r in rows if r["turn"] == t]
        by_turn[t] = {
            "ttft_p50_ms": statistics.median(r["first_token_ms"] for r in rs),
            "bytes_per_request": statistics.fmean(r["bytes"] for r in rs),
        }
    later = [r for r in rows if r["turn"] >= 2]
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    return {
        "label": f"{'cache' if caching else 'no-cache'}+{policy}",
        "by_turn": by_turn,
        "ttft_p50_ms_turn2plus": statistics.median(r["first_token_ms"] for r in later),
        "bytes_per_request_turn2plus": statistics.fmean(r["bytes"] for r in later),
        "prefill_hit_rate": sum(r["prefill_cached_tokens"] or 0 for r in rows) / prompt_tokens,
        "decode_hit_rate": sum(r["decode_cached_tokens"] or 0 for r in rows) / prompt_tokens,
        "requests": len(rows),
    }


# ----------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["capacity", "multiturn", "both"], default="both")
    p.add_argument("--num-blocks", type=int, default=CapacityConfig.num_blocks, help="capacity: KV blocks in the pool")
    p.add_argument("--requests", type=int, default=CapacityConfig.requests, help="capacity: requests sent")
    p.add_argument("--max-tokens", type=int, default=CapacityConfig.max_tokens, help="capacity: each request's budget")
    p.add_argument("--output-min", type=int, default=CapacityConfig.output_min, help="capacity: shortest output")
    p.add_argument("--output-max", type=int, default=CapacityConfig.output_max, help="capacity: longest output")
    p.add_argument("--conversations", type=int, default=MultiTurnConfig.conversations, help="multiturn: chats")
    p.add_argument("--turns", type=int, default=MultiTurnConfig.turns, help="multiturn: turns per chat")
    p.add_argument("--system-len", type=int, default=MultiTurnConfig.system_len, help="multiturn: shared prefix")
    p.add_argument("--json", action="store_true", help="print the result as one JSON document")
    p.add_argument("--out", default=None, help="result name (default: kvcache)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)


def main(args: argparse.Namespace) -> int:
    from cli import CliError  # noqa: PLC0415

    if min(args.num_blocks, args.requests, args.conversations, args.turns, args.system_len, args.output_min) < 1:
        raise CliError("--num-blocks, --requests, --conversations, --turns, --system-len, --output-min must be >= 1")
    if not args.output_min <= args.output_max <= args.max_tokens:
        raise CliError("need --output-min <= --output-max <= --max-tokens")
    result: dict[str, Any] = {}
    lines = []
    if args.part in ("capacity", "both"):
        cap = CapacityConfig(
            num_blocks=args.num_blocks,
            requests=args.requests,
            max_tokens=args.max_tokens,
            output_min=args.output_min,
            output_max=args.output_max,
        )
        runs = [run_capacity(cap, reserve=False), run_capacity(cap, reserve=True)]
        ratio = runs[0]["mean_running"] / runs[1]["mean_running"]
        result["capacity"] = {"config": cap.__dict__, "runs": runs, "mean_running_ratio": ratio}
        lines += [
            f"capacity: {cap.num_blocks} blocks x {cap.block_size} tokens, {cap.requests} requests, prompt "
            f"{cap.prompt_len}, max_tokens {cap.max_tokens}, outputs {cap.output_min}-{cap.output_max}",
            f"{'policy':<12}{'mean running':>14}{'peak':>8}{'preemptions':>13}{'steps':>8}",
            *(
                f"{r['policy']:<12}{r['mean_running']:>14.1f}{r['peak_running']:>8}{r['preemptions']:>13}{r['steps']:>8}"
                for r in runs
            ),
            f"on demand / reserved, mean concurrent sequences: {ratio:.2f}x",
        ]
    if args.part in ("multiturn", "both"):
        mt = MultiTurnConfig(conversations=args.conversations, turns=args.turns, system_len=args.system_len)
        runs = [run_multiturn(mt, False, "round_robin"), run_multiturn(mt, True, "prefix")]
        base, best = runs
        result["multiturn"] = {
            "config": mt.__dict__,
            "runs": runs,
            "ttft_p50_ratio_turn2plus": base["ttft_p50_ms_turn2plus"] / best["ttft_p50_ms_turn2plus"],
            "bytes_ratio_turn2plus": base["bytes_per_request_turn2plus"]
            / max(1.0, best["bytes_per_request_turn2plus"]),
        }
        lines += [
            f"multiturn: {mt.prefill}P{mt.decode}D, {mt.conversations} chats x {mt.turns} turns, system prompt "
            f"{mt.system_len}, user {mt.user_len}, output {mt.output_len} tokens",
            f"{'run':<22}"
            + "".join(f"{'TTFT p50 t' + str(t):>14}" for t in range(1, mt.turns + 1))
            + f"{'bytes/req t2+':>15}{'hit P':>8}{'hit D':>8}",
            *(
                f"{r['label']:<22}"
                + "".join(f"{r['by_turn'][t]['ttft_p50_ms']:>12.1f}ms" for t in range(1, mt.turns + 1))
                + f"{r['bytes_per_request_turn2plus']:>15,.0f}{r['prefill_hit_rate']:>8.2f}{r['decode_hit_rate']:>8.2f}"
                for r in runs
            ),
            f"from turn 2: TTFT p50 {result['multiturn']['ttft_p50_ratio_turn2plus']:.2f}x lower, "
            f"KV bytes/request {result['multiturn']['bytes_ratio_turn2plus']:.2f}x lower with caching + prefix",
        ]
    path = write_result(
        args.out or "kvcache", result, {"part": args.part}, Path(args.out_dir) if args.out_dir else None
    )
    if args.json:
        emit_json({"result_file": str(path), **result})
    else:
        print("\n".join(lines))
        print(f"results: {path}")
    return 0
