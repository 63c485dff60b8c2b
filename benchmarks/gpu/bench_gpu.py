"""`pdserve bench gpu`: does the engine run near the GPU's limits? One script, one device call.

Sections, in order (each has a time cap and the whole run a budget; results are written after
every section, so a run cut short still leaves its numbers):

  ceilings    device-to-device copy bandwidth, and `_scaled_mm` FP8 TFLOP/s at the model's GEMM
              shapes for M = 16 .. 16k (the two roofs, measured in this run)
  decode      CUDA-graph decode step, batch 1..256 at 4k context, against the memory floor
              (weight + KV bytes / measured copy bandwidth); `llama-3.1-8b`, then `llama-3.1-70b`
              (last: it needs the card to itself) at the batches that fit
  prefill     one prompt of 1k..32k tokens: time and MFU against the best measured FP8 rate
  green       decode ITL (batch 32, 4k) while 8k-token prefills run back to back: decode alone,
              colocated (one stream), two streams time-sharing the card, green-context SM splits
  hf          transformers LlamaForCausalLM, bf16, random weights, same config: 4k prefill and
              batch-32 decode at 4k context (the baseline a user would otherwise pick)
  transfer    671 MB (a 4k-token 70B prompt's FP8 KV) between two processes on the card: NIXL
              (UCX cuda_ipc) when pdserve's nixl transport and nixl are importable, else CUDA IPC
              through torch.multiprocessing, against the copy ceiling

All timings are CUDA events after warm-up; ratios compare numbers measured in the same run.
Random weights (seeded); KV pages hold random bytes (timing does not depend on their values).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.ceilings import bench_ceilings
from benchmarks.gpu.colocation import bench_green
from benchmarks.gpu.model_bench import bench_decode, bench_hf, bench_prefill, build_runner
from benchmarks.gpu.transfer import bench_transfer
from cli import CliError
from costmodel.provenance import OUT_DIR_HELP

SECTIONS = ("ceilings", "decode", "prefill", "green", "hf", "transfer")
TARGETS = {  # the fractions of the device's limits the CUDA path is meant to reach; the report marks each
    "decode_b64_8b_floor_fraction": 0.70,
    "prefill_4k_fp8_fraction": 0.50,
    "decode_b32_vs_hf": 5.0,
    "transfer_671mb_copy_fraction": 0.80,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    p.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b", help="decode/prefill presets (8b first)")
    p.add_argument("--budget-s", type=float, default=340.0, help="whole-run budget; sections past it are skipped")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--prefill-lens", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--green-sms", default="16,32,64", help="decode SM counts to try for the green split")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--git-commit", default=None, help="record this commit (when .git is not on the machine)")


class Budget:
    """Wall-clock budget for the whole run; `run` skips a section left with under 10 s of it."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# ---- driver -------------------------------------------------------------------------------------
def _ints(s: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise CliError(f"{flag} must be a comma list of integers, got {s!r}") from None


def _free_cuda() -> None:
    import gc  # noqa: PLC0415

    gc.collect()
    torch.cuda.empty_cache()


def check_targets(res: dict) -> list[dict]:
    s = res["sections"]
    got: dict[str, float | None] = dict.fromkeys(TARGETS)
    d8 = next((r for r in s.get("decode", {}).get("llama-3.1-8b", {}).get("rows", []) if r["batch"] == 64), None)
    got["decode_b64_8b_floor_fraction"] = d8 and d8["floor_fraction"]
    p4 = next((r for r in s.get("prefill", {}).get("llama-3.1-8b", []) if r["tokens"] == 4096), None)
    got["prefill_4k_fp8_fraction"] = p4 and p4["fraction_of_fp8_peak"]
    d32 = next((r for r in s.get("decode", {}).get("llama-3.1-8b", {}).get("rows", []) if r["batch"] == 32), None)
    hf = s.get("hf", {}).get("decode_tokens_per_s")
    got["decode_b32_vs_hf"] = d32["tokens_per_s"] / hf if d32 and hf else None
    got["transfer_671mb_copy_fraction"] = s.get("transfer", {}).get("cuda_ipc", {}).get("copy_fraction")
    return [
        {"target": k, "want_at_least": TARGETS[k], "measured": v, "pass": None if v is None else v >= TARGETS[k]}
        for k, v in got.items()
    ]


def main(args: argparse.Namespace) -> int:
    from costmodel.provenance import write_result  # noqa: PLC0415
    from engine.config import PRESETS  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise CliError("bench gpu needs a CUDA device (this machine has none); see benchmarks/gpu/device_run.sh")
    sections = [x for x in args.sections.split(",") if x]
    models = [x for x in args.models.split(",") if x]
    bad = [x for x in sections if x not in SECTIONS] + [m for m in models if m not in PRESETS]
    if bad or not models:
        raise CliError(f"unknown section/model {bad}; sections: {', '.join(SECTIONS)}; models: {', '.join(PRESETS)}")
    batches, lens, sms = (
        _ints(args.batches, "--batches"),
        _ints(args.prefill_lens, "--prefill-lens"),
        _ints(args.green_sms, "--green-sms"),
    )
    budget = Budget(args.budget_s)
    res: dict[str, Any] = {
        "targets": TARGETS,
        "sections": {},
        "errors": {},
        "device": torch.cuda.get_device_name(0),
        "source_commit": args.git_commit,
    }
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    out_dir = Path(args.out_dir) if args.out_dir else None

    def save() -> None:
        write_result("gpu_bench", res, config=config, out_dir=out_dir)

    def run(name: str, cap: float, fn: Callable[[float], Any]) -> Any:
        cap = min(cap, budget.left())
        if cap < 10:
            res["errors"][name] = "skipped: run budget spent"
            return None
        t0 = time.perf_counter()
        print(f"[bench gpu] {name} (cap {cap:.0f}s, {budget.left():.0f}s left)", flush=True)
        try:
            return fn(cap)
        except Exception as e:  # noqa: BLE001 (one failed section must not lose the others' numbers)
            res["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"[bench gpu] {name} failed: {res['errors'][name]}", flush=True)
            return None
        finally:
            res.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
            save()

    cfgs = [PRESETS[m] for m in models]
    ceil = run("ceilings", 40, lambda cap: bench_ceilings(cfgs, cap)) if "ceilings" in sections else None
    if ceil:
        res["sections"]["ceilings"] = ceil
    copy_bw = ceil["copy"]["copy_GBps_read_plus_write"] * 1e9 if ceil else 4.3e12  # KINDS.md's reading if skipped
    fp8_peak = ceil and ceil["fp8_peak_TFLOPs"]
    first, rest = models[0], models[1:]
    need_runner = {"decode", "prefill", "green"} & set(sections)
    runner = graphs = None
    if need_runner:

        def decode_first(cap):
            nonlocal runner, graphs
            r, fit, init_s = build_runner(first, batches, extra_blocks=max(lens) // 16 if lens else 0, reserve_gb=12)
            runner = r
            d = bench_decode(r, fit, copy_bw, cap) if ({"decode", "green"} & set(sections)) else {"rows": []}
            graphs = d.pop("_graphs", None)
            d.update(init_s=init_s, num_blocks=r.cache_cfg.num_blocks)
            res["sections"].setdefault("decode", {})[first] = d

        run(f"decode:{first}", 150, decode_first)
    if runner is not None and "prefill" in sections:
        res["sections"]["prefill"] = {
            first: run(f"prefill:{first}", 60, lambda cap: bench_prefill(runner, lens, fp8_peak, cap))
        }
    if runner is not None and graphs is not None and "green" in sections:
        res["sections"]["green"] = run("green", 100, lambda cap: bench_green(runner, graphs, sms, cap))
    runner = graphs = None
    _free_cuda()
    if "hf" in sections:
        res["sections"]["hf"] = run("hf", 100, lambda cap: bench_hf(first, cap))
        _free_cuda()
    if "transfer" in sections:
        res["sections"]["transfer"] = run(
            "transfer", 60, lambda cap: bench_transfer(ceil["copy"]["copy_GBps_one_way"] if ceil else None, cap)
        )
    for m in rest if "decode" in sections else []:

        def decode_more(cap, m=m):
            r, fit, init_s = build_runner(m, [b for b in batches if b <= 64], extra_blocks=0, reserve_gb=6)
            d = bench_decode(r, fit, copy_bw, cap)
            d.pop("_graphs", None)
            d.update(init_s=init_s, num_blocks=r.cache_cfg.num_blocks)
            res["sections"].setdefault("decode", {})[m] = d

        run(f"decode:{m}", 150, decode_more)
        _free_cuda()
    res["target_check"] = check_targets(res)
    save()
    print_summary(res)
    return 0


def print_summary(res: dict) -> None:
    s = res["sections"]
    print(f"\n== bench gpu on {res['device']} ==")
    if "ceilings" in s:
        c = s["ceilings"]
        print(
            f"copy {c['copy']['copy_GBps_read_plus_write']:.0f} GB/s (read+write); "
            f"best _scaled_mm {c['fp8_peak_TFLOPs'] or float('nan'):.0f} TFLOP/s"
        )
    for m, d in s.get("decode", {}).items():
        for r in d.get("rows", []):
            print(
                f"decode {m:14s} B={r['batch']:4d} step {r['step_ms']:7.2f} ms  floor {r['floor_ms']:7.2f} ms "
                f"({r['floor_fraction']:.0%})  {r['tokens_per_s']:9.0f} tok/s"
            )
    for m, rows in (s.get("prefill") or {}).items():
        for r in rows or []:
            print(
                f"prefill {m:13s} T={r['tokens']:6d} {r['ms']:8.1f} ms  {r['TFLOPs']:6.0f} TFLOP/s "
                f"({(r['fraction_of_fp8_peak'] or 0):.0%} of FP8 peak)"
            )
    for r in (s.get("green") or {}).get("rows", []):
        print(
            f"itl {r['mode']:13s} sms={r['decode_sms']}: p50 {r['itl_p50_ms']:.2f} p99 {r['itl_p99_ms']:.2f} ms, "
            f"prefill {r['prefill_tokens_per_s']:.0f} tok/s"
        )
    if s.get("hf"):
        print(
            f"transformers: prefill 4k {s['hf'].get('prefill_4k_ms', float('nan')):.1f} ms, "
            f"decode B=32 {s['hf'].get('decode_tokens_per_s', float('nan')):.0f} tok/s"
        )
    ipc = (s.get("transfer") or {}).get("cuda_ipc")
    if ipc:
        print(
            f"671 MB CUDA IPC: {ipc['GBps']:.0f} GB/s ({(ipc['copy_fraction'] or 0):.0%} of copy), "
            f"verified={ipc['verified']}"
        )
    for t in res.get("target_check", []):
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        m = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"target {t['target']:32s} >= {t['want_at_least']:<5} measured {m:>6}  {verdict}")
    for k, v in res.get("errors", {}).items():
        print(f"error {k}: {v}")


if __name__ == "__main__":
    import sys

    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.bench_gpu", description=__doc__.splitlines()[0])
    add_arguments(ap)
    try:
        sys.exit(main(ap.parse_args()))
    except CliError as e:
        print(f"bench gpu: error: {e}", file=sys.stderr)
        sys.exit(2)
