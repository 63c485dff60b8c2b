"""`pdserve bench rss-shapes`: what a worker's memory does when every prompt has a new length,
with each suspect of issue 22 switched off in turn (an A/B in one invocation).

Each variant runs in its own child process (the oneDNN and glibc settings are read once, at the
first GEMM or allocation), without Ray or a server: an LLMEngine in prefill-only mode, as a
prefill worker runs it, prefills `--prompts` prompts one at a time and releases each, with prefix
caching off. The RSS (/proc/self/status) is taken after the first prompt (warm) and at the end;
glibc's `mallinfo2` tells whether the growth is malloc'd memory in use (a cache) or freed memory
the heap keeps (fragmentation); tracemalloc, in its own variant, counts Python objects.

Variants: `fixed` (one length, the control), `distinct` (new lengths, buckets off: the growth),
then `distinct` with one suspect off: `trim` (malloc_trim after every prompt), `arena1`
(MALLOC_ARENA_MAX=1), `onednn-cache0` (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0), `ideep-cache1`
(LRU_CACHE_CAPACITY=1, ideep's computation cache), `both-caches`, `no-onednn` (plain torch
matmul instead of the oneDNN packed kernel), `tracemalloc`; and `buckets` (the fix: GEMM row
buckets on, engine/model/linear.py), alone and with `trim` or a fixed 64 KB mmap threshold
(MALLOC_MMAP_THRESHOLD_, which also stops glibc raising it as large blocks are freed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from cli import CliError
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result

# variant -> (environment, child options)
VARIANTS: dict[str, tuple[dict[str, str], dict[str, bool]]] = {
    "fixed": ({}, {"fixed": True}),
    "distinct": ({}, {}),
    "trim": ({}, {"trim": True}),
    "arena1": ({"MALLOC_ARENA_MAX": "1"}, {}),
    "onednn-cache0": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}, {}),
    "ideep-cache1": ({"LRU_CACHE_CAPACITY": "1"}, {}),
    "both-caches": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "LRU_CACHE_CAPACITY": "1"}, {}),
    "no-onednn": ({}, {"no_onednn": True}),
    "tracemalloc": ({}, {"tracemalloc": True}),
    "buckets": ({}, {"buckets": True}),
    # what is left with the buckets on: the allocator's share
    "buckets-trim": ({}, {"buckets": True, "trim": True}),
    "buckets-mmap64k": ({"MALLOC_MMAP_THRESHOLD_": "65536"}, {"buckets": True}),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset or checkpoint directory (default tiny)")
    p.add_argument("--prompts", type=int, default=200, help="prompts per variant (default 200)")
    p.add_argument("--min-len", type=int, default=15)
    p.add_argument("--max-len", type=int, default=1485, help="prompt lengths drawn in min..max (default 15..1485)")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated (default all: {','.join(VARIANTS)})"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per child (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="rss-shapes", help="result file name")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--json", action="store_true", help="print the result object as JSON instead of the table")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one variant, print JSON


# ------------------------------------------------------------------------------ one variant (child)
def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def _mallinfo(libc: ctypes.CDLL | None) -> dict[str, float]:
    """glibc's heap figures in MB: in use (uordblks + mmapped hblkhd) and free but kept (fordblks)."""
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return {"in_use_mb": (m.uordblks + m.hblkhd) / 1024**2, "free_kept_mb": m.fordblks / 1024**2}


def run_variant(args: argparse.Namespace, name: str) -> dict:
    import torch  # noqa: PLC0415 - the child only

    from engine import torch_compat  # noqa: PLC0415
    from engine.config import CacheConfig, is_checkpoint_dir, resolve_model_config  # noqa: PLC0415
    from engine.core.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.model import linear  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415

    opts = VARIANTS[name][1]
    torch.set_num_threads(args.threads)
    try:
        libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    except OSError:
        libc = None
    if opts.get("tracemalloc"):
        import tracemalloc  # noqa: PLC0415

        tracemalloc.start()
    cfg = resolve_model_config(args.model)
    ckpt = args.model if is_checkpoint_dir(args.model) else None
    buckets = linear.RowBuckets() if opts.get("buckets") else linear.RowBuckets(per_octave=0)
    blocks = -(-(args.max_len + 1) // 16) + 1
    runner = ModelRunner(cfg, CacheConfig(block_size=16, num_blocks=blocks), "fp8", "cpu", ckpt, row_buckets=buckets)
    if opts.get("no_onednn"):
        torch_compat.ONEDNN_LINEAR = False  # every GEMM: plain torch matmul (MKL), nothing packed or cached per shape
    engine = LLMEngine(runner, prefill_only=True, enable_prefix_caching=False)
    rng = random.Random(args.seed)
    mid = (args.min_len + args.max_len) // 2
    lengths = [mid if opts.get("fixed") else rng.randint(args.min_len, args.max_len) for _ in range(args.prompts)]
    vocab = min(cfg.vocab_size, 256)
    curve, t0 = [], time.perf_counter()
    rss0 = heap0 = py0 = None
    for i, n in enumerate(lengths):
        seq = Sequence(f"s{i}", [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=1))
        engine.add_request(seq)
        while engine.has_work:
            engine.step()
        engine.release(seq.seq_id)
        if opts.get("trim") and libc is not None:
            libc.malloc_trim(0)
        if i == 0:  # warm: weights dequantized and packed, first shapes built
            rss0, heap0 = _rss_mb(), _mallinfo(libc)
            if opts.get("tracemalloc"):
                py0 = tracemalloc.get_traced_memory()[0]
        if (i + 1) % max(1, args.prompts // 10) == 0:
            curve.append((i + 1, round(_rss_mb(), 1)))
    wall = time.perf_counter() - t0
    rss1, heap1 = _rss_mb(), _mallinfo(libc)
    assert rss0 is not None and heap0 is not None
    out = {
        "variant": name,
        "env": VARIANTS[name][0],
        "rss_warm_mb": round(rss0, 1),
        "rss_end_mb": round(rss1, 1),
        "growth_mb": round(rss1 - rss0, 1),
        "distinct_lengths": len(set(lengths)),
        "wall_s": round(wall, 2),
        "curve": curve,
    }
    if heap0 and heap1:
        out["heap_in_use_growth_mb"] = round(heap1["in_use_mb"] - heap0["in_use_mb"], 1)
        out["heap_free_kept_growth_mb"] = round(heap1["free_kept_mb"] - heap0["free_kept_mb"], 1)
    if py0 is not None:
        out["python_heap_growth_mb"] = round((tracemalloc.get_traced_memory()[0] - py0) / 1024**2, 2)
    return out


# ------------------------------------------------------------------------------ the A/B (parent)
def main(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(run_variant(args, args.child)))
        return 0
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or args.prompts < 2 or not 1 <= args.min_len <= args.max_len:
        raise CliError(
            f"unknown variants {unknown}" if unknown else "need --prompts >= 2 and 1 <= --min-len <= --max-len"
        )
    rows = []
    for name in names:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **VARIANTS[name][0]}
        cmd = [sys.executable, "-m", "cli", "bench", "rss-shapes", "--child", name, "--model", args.model,
               "--prompts", str(args.prompts), "--min-len", str(args.min_len), "--max-len", str(args.max_len),
               "--threads", str(args.threads), "--seed", str(args.seed)]  # fmt: skip
        print(f"variant {name} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise CliError(f"variant {name} failed:\n{done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"  {name}: RSS {r['rss_warm_mb']:.0f} -> {r['rss_end_mb']:.0f} MB, curve {[m for _, m in r['curve']]}",
              file=sys.stderr, flush=True)  # fmt: skip
    base = next((r for r in rows if r["variant"] == "distinct"), None)
    for r in rows:
        r["growth_vs_distinct_pct"] = (
            round(100 * r["growth_mb"] / base["growth_mb"], 1) if base and base["growth_mb"] else None
        )
    result = {"model": args.model, "prompts": args.prompts, "lengths": [args.min_len, args.max_len], "variants": rows}
    config = {k: v for k, v in vars(args).items() if k != "child"}
    path = write_result(args.name, result, config=config, out_dir=Path(args.out_dir) if args.out_dir else RESULTS_DIR)
    if args.json:
        from cli.output import emit_json  # noqa: PLC0415 - only for --json

        emit_json(result)
    else:
        _print_table(result)
        print(f"\nwrote {path}")
    return 0


def _print_table(r: dict) -> None:
    print(f"{r['model']}: {r['prompts']} prefills, lengths {r['lengths'][0]}..{r['lengths'][1]}, RSS in MB")
    print(f"{'variant':<14} {'lengths':>7} {'warm':>7} {'end':>7} {'growth':>7} {'% of bug':>8} {'heap used':>9} "
          f"{'heap free':>9} {'python':>7} {'wall s':>7}")  # fmt: skip
    for v in r["variants"]:
        pct = v["growth_vs_distinct_pct"]

        def fmt(key: str) -> str:
            return f"{v[key]:.1f}" if key in v else "-"

        print(f"{v['variant']:<14} {v['distinct_lengths']:>7} {v['rss_warm_mb']:>7.0f} {v['rss_end_mb']:>7.0f} "
              f"{v['growth_mb']:>7.0f} {pct if pct is not None else '-':>8} {fmt('heap_in_use_growth_mb'):>9} "
              f"{fmt('heap_free_kept_growth_mb'):>9} {fmt('python_heap_growth_mb'):>7} "
              f"{v['wall_s']:>7.1f}")  # fmt: skip
