"""`pdserve bench kvcache`: what the KV cache manager buys, measured.

Two parts (`--part capacity|multiturn|both`):

- capacity (in this process, one engine, the tiny model): the same stream of requests
  (`max_tokens` 1024, outputs drawn in 100-300 tokens: the request ends there, as at an EOS) on
  the same pool, blocks given on demand vs prompt + max_tokens reserved at admission. Reported:
  concurrent running sequences (the capacity: mean over the steps while requests still wait for
  the pool; also the mean over all busy steps and the peak), preemptions, steps to finish; beside
  them, the article's capacity table and its KV accounting applied to this pool (predicted, not
  measured: costmodel/article/kv_capacity.py).
- multiturn (real servers: Ray, NIXL, uvicorn, the openai client): 2P2D disaggregated, chats that
  share a system prompt and grow turn by turn (each turn's prompt = the previous prompt + its
  reply + a new user message, sent as token ids; benchmarks/client/multiturn.py). Run on a fresh server
  for each setting: prefix caching off + round_robin (the baseline), caching on + round_robin,
  caching on + `--policy prefix` (the target). Reported per run: TTFT by turn (server side:
  arrival to first token, from the request timeline), KV bytes pulled per request, prefix hit
  rate on each side; and baseline / target from turn 2.

Writes one JSON with provenance (benchmarks/results/local/ by default) and prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.client.multiturn import MultiTurnWorkload, run_chats, summarize, table
from cli.output import emit_json
from costmodel.article import cost_model as cm
from costmodel.article import kv_capacity as kv
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


def draw_requests(cfg: CapacityConfig) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of each request: the same seeded stream for both policies."""
    rng = random.Random(cfg.seed)
    return [
        ([rng.randrange(32, 127) for _ in range(cfg.prompt_len)], rng.randint(cfg.output_min, cfg.output_max))
        for _ in range(cfg.requests)
    ]


def predicted_pool(cfg: CapacityConfig) -> kv.PoolCapacity:
    """The article's KV accounting for this pool and this request stream (the tiny model, as
    run_capacity serves it): what the measured runs are set against."""
    from engine.config import PRESETS  # noqa: PLC0415 - torch only when this part runs

    return kv.pool_capacity(
        cm.ModelSpec.from_config(PRESETS["tiny"]),
        cfg.num_blocks,
        cfg.block_size,
        cfg.prompt_len,
        cfg.max_tokens,
        [n for _, n in draw_requests(cfg)],
    )


def run_capacity(cfg: CapacityConfig, reserve: bool) -> dict[str, Any]:
    from engine.config import PRESETS, CacheConfig  # noqa: PLC0415 - torch only when this part runs
    from engine.core.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415

    runner = ModelRunner(
        PRESETS["tiny"], CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks, kv_dtype="fp8"), "fp8"
    )
    engine = LLMEngine(runner, max_num_seqs=cfg.max_num_seqs, reserve_budget=reserve, enable_prefix_caching=False)
    target: dict[str, int] = {}
    for i, (prompt, output_len) in enumerate(draw_requests(cfg)):
        seq = Sequence(f"c{i}", prompt, SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True))
        target[seq.seq_id] = output_len
        engine.add_request(seq)
    running, saturated, steps, t0 = [], [], 0, time.perf_counter()
    emitted = 0
    while engine.has_work:
        waiting = bool(engine.waiting)  # requests still queued: the pool, not the demand, is the limit
        events = engine.step()
        steps += 1
        running.append(len(engine.running))
        if waiting:
            saturated.append(len(engine.running))
        for ev in events:  # the drawn output length plays the part of an EOS
            emitted += 1
            if not ev.finished and ev.index + 1 >= target[ev.seq_id]:
                engine.abort(ev.seq_id)
        engine.blocks.check() if steps % 64 == 0 else None
    assert engine.blocks.check().in_use == 0
    assert emitted == sum(target.values()), "every request emits exactly its drawn output length, once"
    busy = [r for r in running if r]
    return {
        "policy": "reserved" if reserve else "on_demand",
        # the capacity: sequences the pool holds while requests are still waiting for it
        "mean_running_saturated": statistics.fmean(saturated) if saturated else statistics.fmean(busy),
        "saturated_steps": len(saturated),
        "mean_running": statistics.fmean(busy),
        "peak_running": max(running),
        "preemptions": engine.preemptions,
        "steps": steps,
        "tokens_emitted": emitted,
        "seconds": time.perf_counter() - t0,
    }


# ----------------------------------------------------------------------------- multi-turn
# (prefix caching, routing policy): the baseline first, its target last
SETTINGS = ((False, "round_robin"), (True, "round_robin"), (True, "prefix"))


@dataclass(frozen=True)
class ServerSetup:
    model: str = "tiny"
    prefill: int = 2
    decode: int = 2
    num_blocks: int = 1024


def run_multiturn(setup: ServerSetup, wl: MultiTurnWorkload, caching: bool, policy: str) -> dict[str, Any]:
    """One fresh server (empty caches, empty router index), the whole workload, its summary."""
    from router.config import ServeConfig  # noqa: PLC0415 - Ray only when this part runs
    from router.serve_cli import ServerThread  # noqa: PLC0415

    serve = ServeConfig(
        mode="disagg",
        model=setup.model,
        prefill=setup.prefill,
        decode=setup.decode,
        policy=policy,
        prefix_cache=caching,
        num_blocks=setup.num_blocks,
        port=0,
    )
    with ServerThread(serve, startup_timeout_s=300) as srv:
        rows = asyncio.run(run_chats(srv.base_url, wl))
    return {"label": f"{'cache' if caching else 'no-cache'}+{policy}", **summarize(rows, wl.turns)}


# ----------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    c, w, m = CapacityConfig(), MultiTurnWorkload(), ServerSetup()
    p.add_argument("--part", choices=["capacity", "multiturn", "both"], default="both")
    p.add_argument("--num-blocks", type=int, default=c.num_blocks, help="capacity: KV blocks in the pool")
    p.add_argument("--requests", type=int, default=c.requests, help="capacity: requests sent")
    p.add_argument("--max-tokens", type=int, default=c.max_tokens, help="capacity: each request's budget")
    p.add_argument("--output-min", type=int, default=c.output_min, help="capacity: shortest output")
    p.add_argument("--output-max", type=int, default=c.output_max, help="capacity: longest output")
    p.add_argument("--model", default=m.model, help="multiturn: model served (e.g. smollm2-135m-instruct)")
    p.add_argument("--prefill", type=int, default=m.prefill, help="multiturn: prefill workers")
    p.add_argument("--decode", type=int, default=m.decode, help="multiturn: decode workers")
    p.add_argument("--conversations", type=int, default=w.conversations, help="multiturn: chats")
    p.add_argument("--turns", type=int, default=w.turns, help="multiturn: turns per chat")
    p.add_argument("--system-len", type=int, default=w.system_len, help="multiturn: shared prefix")
    p.add_argument("--user-len", type=int, default=w.user_len, help="multiturn: tokens per user message")
    p.add_argument("--output-len", type=int, default=w.output_len, help="multiturn: tokens per reply")
    p.add_argument("--json", action="store_true", help="print the result as one JSON document")
    p.add_argument("--out", default=None, help="result name (default: kvcache)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)


def _article(cap: CapacityConfig) -> dict[str, Any]:
    """The article's arithmetic beside the measurement: its capacity table (Llama-3.1-70B FP8 on
    one H100, each sequence charged its real 4,096-token context) and the same KV accounting
    applied to this pool and workload (costmodel/article/kv_capacity.py)."""
    pool = predicted_pool(cap)
    rates = (0.25, 0.5, 1.0, 2.0)
    table = cm.capacity_table(cm.ARTICLE_MODEL, cm.ARTICLE_HW, rates)
    batch = kv.article_batch_kv(cm.ARTICLE_MODEL, cm.ARTICLE_HW)
    return {
        "source": "arithmetic (the article's cost model), not measured",
        "article_table": [asdict(r) for r in table],
        "article_batch_kv": {**asdict(batch), "fits_one_gpu": batch.fits_one_gpu, "batch": 32, "ctx": 4096},
        "this_pool": {**asdict(pool), "ratio": pool.ratio, "ratio_blocks": pool.ratio_blocks},
    }


_T = TypeVar("_T")


def _from_flags(cls: Callable[..., _T], args: argparse.Namespace, *names: str) -> _T:
    """`cls` with the fields the flags of the same names set; the others keep their defaults."""
    return cls(**{name: getattr(args, name) for name in names})


def _workload(args: argparse.Namespace) -> MultiTurnWorkload:
    """The multiturn workload the flags ask for (checked by main before anything runs)."""
    return _from_flags(MultiTurnWorkload, args, "conversations", "turns", "system_len", "user_len", "output_len")


def _capacity(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    cap = _from_flags(CapacityConfig, args, "num_blocks", "requests", "max_tokens", "output_min", "output_max")
    runs = [run_capacity(cap, reserve=False), run_capacity(cap, reserve=True)]
    ratio = runs[0]["mean_running_saturated"] / runs[1]["mean_running_saturated"]
    art = _article(cap)
    pool, ab = art["this_pool"], art["article_batch_kv"]
    predicted = {"on_demand": pool["on_demand_sequences"], "reserved": pool["reserved_sequences"]}
    in_blocks = {"on_demand": pool["on_demand_sequences_blocks"], "reserved": pool["reserved_sequences_blocks"]}
    lines = [
        f"capacity: {cap.num_blocks} blocks x {cap.block_size} tokens ({pool['pool_tokens']:,} tokens, "
        f"{pool['pool_bytes'] / 2**20:.1f} MiB of FP8 KV), {cap.requests} requests, prompt {cap.prompt_len}, "
        f"max_tokens {cap.max_tokens}, outputs {cap.output_min}-{cap.output_max}",
        "article's capacity table (Llama-3.1-70B FP8, one H100, arithmetic): decode sequences that fit "
        + ", ".join(f"{r['decode_sequences']:.1f} at {r['prefills_per_s']:g}" for r in art["article_table"])
        + f" prefills/s, each charged its real context: 4,096 tokens = {ab['kv_bytes_per_sequence'] / 1e6:.0f} MB",
        f"the same accounting for this pool: reserved charges the budget ({pool['reserved_context']} tokens), "
        f"on demand the context really held ({pool['on_demand_context']:.1f} tokens, mean over running steps)",
        f"{'policy':<12}{'predicted':>11}{'in blocks':>11}{'measured':>10}{'peak':>6}{'preemptions':>13}{'steps':>8}",
        *(
            f"{r['policy']:<12}{predicted[r['policy']]:>11.1f}{in_blocks[r['policy']]:>11.1f}"
            f"{r['mean_running_saturated']:>10.1f}{r['peak_running']:>6}{r['preemptions']:>13}{r['steps']:>8}"
            for r in runs
        ),
        f"on demand / reserved, concurrent sequences while requests wait: measured {ratio:.2f}x, "
        f"article arithmetic {pool['ratio']:.2f}x ({pool['ratio_blocks']:.2f}x in whole blocks)",
    ]
    result = {"config": asdict(cap), "runs": runs, "concurrent_ratio": ratio, "article": art}
    return result, lines


def _multiturn(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    setup = _from_flags(ServerSetup, args, "model", "prefill", "decode")
    wl = _workload(args)
    runs = [run_multiturn(setup, wl, caching, policy) for caching, policy in SETTINGS]
    base, best = runs[0], runs[-1]  # neither vs caching + prefix routing: the target
    ttft_ratio = base["ttft_p50_ms_turn2plus"] / best["ttft_p50_ms_turn2plus"]
    bytes_ratio = base["bytes_per_request_turn2plus"] / max(1.0, best["bytes_per_request_turn2plus"])
    lines = [
        f"multiturn: {setup.model}, {setup.prefill}P{setup.decode}D, {wl.conversations} chats x {wl.turns} turns, "
        f"system prompt {wl.system_len}, user {wl.user_len}, output {wl.output_len} tokens",
        *table([(r["label"], r) for r in runs], wl.turns),
        f"from turn 2, {best['label']} vs {base['label']}: TTFT p50 {ttft_ratio:.2f}x lower, "
        f"KV bytes/request {bytes_ratio:.2f}x lower",
    ]
    result = {
        "server": asdict(setup),
        "workload": asdict(wl),
        "runs": runs,
        "ttft_p50_ratio_turn2plus": ttft_ratio,
        "bytes_ratio_turn2plus": bytes_ratio,
    }
    return result, lines


def main(args: argparse.Namespace) -> int:
    from cli import CliError  # noqa: PLC0415

    if min(args.num_blocks, args.requests, args.output_min, args.prefill, args.decode) < 1:
        raise CliError("--num-blocks, --requests, --output-min, --prefill, --decode must be >= 1")
    if not args.output_min <= args.output_max <= args.max_tokens:
        raise CliError("need --output-min <= --output-max <= --max-tokens")
    try:
        _workload(args).validate()
    except ValueError as e:
        raise CliError(str(e)) from None
    result: dict[str, Any] = {}
    lines: list[str] = []
    load_start = os.getloadavg()  # the machine is shared: how busy it was, beside the figures
    for part, run in (("capacity", _capacity), ("multiturn", _multiturn)):
        if args.part in (part, "both"):
            result[part], more = run(args)
            lines += more
    result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    path = write_result(
        args.out or "kvcache", result, {"part": args.part}, Path(args.out_dir) if args.out_dir else None
    )
    if args.json:
        emit_json({"result_file": str(path), **result})
    else:
        print("\n".join(lines))
        print(f"results: {path}")
    return 0
