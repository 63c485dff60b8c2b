"""`pdserve bench step`: where an engine step's time goes, and transformers `generate` beside it.

For each attention backend and batch size B, B prompts of `--prompt-len` random tokens go through
the serving engine (`LLMEngine`, persistent batch, sampling on the device), all prefilled in one
step, then `--new-tokens` greedy tokens each. Every step is split (engine `StepStats`) into:

- schedule: choosing the step's work and building its inputs from the persistent batch,
- forward: the model (on CUDA until its results are ready: the engine synchronizes for timing),
- sample: sampling on the device and the B ids' trip to the host,
- output: appending tokens, stop checks, rows leaving the batch;

host = schedule + sample + output. Decode steps are summarised by their median.

Beside every decode step, its floor: the bytes of weights a step reads (each once, in the layout
the GEMMs multiply: on CPU the FP8 bytes where the FP8 kernel runs them, else the fp32 copies of
FP8 weights) over the memory bandwidth, measured
just before that row in the same run by a large tensor copy ((read + write) bytes / s, as `bench
gpu` counts it), and the step's ratio to it. The KV bytes the step reads are recorded beside (at
small contexts they are a few percent of the weights). A memory-bound step's cost follows the
bytes it reads, so a batch of 8 should cost about what a batch of 1 does: `vs batch 1` is each
row's decode step over the first batch's (of `--batches`), same backend.

`--compile off,default` adds a row per batch with the decode step compiled by torch.compile
(engine/runner/compiled_decode.py), beside the eager one in the same run, with the compile time.

For a checkpoint (a registry model such as smollm2-135m-instruct, a Hugging Face directory or a
.gguf file), transformers' `generate` runs the same prompts in the same run (greedy, the same
number of new tokens, same torch threads), and its tokens are compared with the engine's: with
fp32 weights and KV they must be equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine import toolkit as eb
from benchmarks.engine.hf_generate import load_hf, run_hf
from benchmarks.engine.step_floor import gemm_shapes, torch_stack_ms, weight_floor
from cli import CliError
from cli.output import emit_json
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result

DEFAULTS = {"batches": "1,16,64,256", "hf_batches": "1,16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.config import PRESETS  # noqa: PLC0415
    from engine.model.attention_registry import BACKENDS  # noqa: PLC0415 (subcommand modules load lazily)

    g = p.add_argument_group("model and device")
    g.add_argument(
        "--model",
        default="tiny",
        help=f"preset ({', '.join(PRESETS)}; random weights), registry model (e.g. smollm2-135m-instruct), "
        "Hugging Face Llama directory or .gguf file (default tiny)",
    )
    eb.add_device_and_dtypes(g, kv_help="default fp8, fp32 with --dtype fp32")
    g.add_argument(
        "--attention",
        default="auto",
        help=f"attention backends to compare, comma-separated ({', '.join(BACKENDS)}; default auto: "
        "the device's fastest). `batched,reference` measures the CPU hot path against the oracle",
    )
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs (default: graphs)")
    g.add_argument(
        "--threads",
        default=None,
        help="torch CPU threads, comma-separated to compare side by side (e.g. 1,2), the same for "
        "transformers (default 1 on CPU: on the shared 2-core VM two OpenMP threads spin against "
        "other processes and turn steps into 10-50x outliers; all cores on CUDA)",
    )
    g.add_argument(
        "--cpu-gemm",
        default="fp32",
        help="dtypes CPU GEMMs multiply in, comma-separated to compare side by side (fp32, bf16, auto: bf16 "
        "for FP8 weights where the CPU has native bf16 dot products; default fp32, as `serve`; engine/model/linear.py)",
    )
    g.add_argument(
        "--compile",
        default="off",
        help="CPU decode step eager (off) and/or compiled by torch.compile (default, max-autotune), "
        "comma-separated to compare side by side (default off; engine/runner/compiled_decode.py)",
    )
    g.add_argument("--seed", type=int, default=0, help="prompts and random weights")
    w = p.add_argument_group("workload")
    w.add_argument("--batches", default=DEFAULTS["batches"], help=f"batch sizes (default {DEFAULTS['batches']})")
    w.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence (default 128)")
    w.add_argument("--new-tokens", type=int, default=48, help="generated tokens per sequence (default 48)")
    w.add_argument(
        "--hf-batches",
        default=DEFAULTS["hf_batches"],
        help=f"batches that also run transformers `generate` (checkpoints only; '' = none; "
        f"default {DEFAULTS['hf_batches']})",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="result name under --out-dir (default: step-<model>-<device>)")
    o.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    o.add_argument("--json", action="store_true", help="print the result as one JSON document instead of the table")
    o.add_argument("--no-progress", action="store_true", help="no per-row progress lines on stderr")


def _variant(row: dict[str, Any]) -> tuple[str, str, int, str]:
    """(attention, cpu_gemm, threads, compile) of a row."""
    return row["attention"], row["cpu_gemm"], row["threads"], row.get("compile", "off")


def _label(row: dict[str, Any]) -> str:
    """A row's variant as the ratios name it: "batched fp32 x1" (+ " compile-default")."""
    comp = row.get("compile", "off")
    return f"{row['attention']} {row['cpu_gemm']} x{row['threads']}" + ("" if comp == "off" else f" compile-{comp}")


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def run_engine(runner: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """All prompts through a fresh LLMEngine on `runner`: timings and the generated ids."""
    from engine.core.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.sequence import SamplingParams, Sequence  # noqa: PLC0415

    B = len(prompts)
    threads = torch.get_num_threads()
    engine = LLMEngine(runner, max_num_seqs=B, max_prefill_tokens=sum(map(len, prompts)))
    engine.sync = True
    if runner.graphs is not None:  # block 0, the first a fresh pool hands out, is the graphs' padding block
        engine.blocks.allocate(1)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    seqs = [Sequence(f"b{i}", p, params) for i, p in enumerate(prompts)]
    for s in seqs:
        engine.add_request(s)
    steps = []
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
        if engine.last_step is not None:
            steps.append(engine.last_step)
    total = time.perf_counter() - t0
    if engine.blocks.num_free != engine.blocks.num_blocks - (1 if runner.graphs is not None else 0):
        raise RuntimeError("bench step leaked KV blocks")
    dec = [s for s in steps if s.prefill_tokens == 0]
    return {
        "e2e_s": total,
        "tokens_per_s": B * new_tokens / total,
        "prefill_steps_s": sum(s.seconds for s in steps if s.prefill_tokens),
        "decode_steps": len(dec),
        "decode_step_ms": _median_ms([s.seconds for s in dec]),
        "host_ms": _median_ms([s.host_s for s in dec]),
        "forward_ms": _median_ms([s.forward_s for s in dec]),
        "schedule_ms": _median_ms([s.schedule_s for s in dec]),
        "sample_ms": _median_ms([s.sample_s for s in dec]),
        "output_ms": _median_ms([s.output_s for s in dec]),
        "graph_steps": runner.graph_steps,
        "torch_threads": threads,
        "_ids": [s.output_ids for s in seqs],
    }


def render(r: dict[str, Any]) -> str:
    rows = []
    for x in r["rows"]:
        hf = x.get("transformers") or {}
        rows.append(
            [
                x["attention"],
                x["cpu_gemm"],
                x.get("compile", "off"),
                str(x["threads"]),
                str(x["batch"]),
                f"{x['decode_step_ms']:.2f}",
                f"{x['decode_step_vs_first_batch']:.2f}x",
                f"{x['floor_ms']:.2f}",
                f"{x['decode_step_over_floor']:.2f}x",
                f"{x['torch_stack_ms']:.2f}" if "torch_stack_ms" in x else "-",
                f"{x['prefill_tokens_per_s']:.0f}",
                f"{x['host_ms']:.3f}",
                f"{x['forward_ms']:.2f}",
                f"{x['schedule_ms']:.3f}/{x['sample_ms']:.3f}/{x['output_ms']:.3f}",
                f"{x['e2e_s']:.2f}",
                f"{x['tokens_per_s']:.0f}",
                f"{hf['e2e_s']:.2f}" if hf else "-",
                f"{x['speedup_vs_transformers']:.2f}x" if hf else "-",
                ("yes" if x["greedy_equal_transformers"] else "NO") if hf else "-",
            ]
        )
    head = (
        f"bench step: {r['model']} ({r['dtype']} weights, {r['kv_dtype']} KV) on {r['device']}, "
        f"{r['prompt_len']}-token prompts, {r['new_tokens']} new tokens\n"
        "floor = the weight bytes a decode step reads in its GEMMs' layout / the (read + write) bandwidth "
        f"of a {r['rows'][0]['copy_bytes'] / 2**20:.0f} MiB tensor copy measured before each row; torch stack = "
        "plain F.linear over the same projections and lm_head in fp32, same rows and threads, measured before "
        "each row"
    )
    headers = [
        "attention",
        "gemm",
        "compile",
        "threads",
        "batch",
        "decode step ms",
        "vs first batch",
        "floor ms",
        "step/floor",
        "torch stack ms",
        "prefill tok/s",
        "host ms",
        "forward ms",
        "sched/sample/out ms",
        "e2e s",
        "tok/s",
        "hf e2e s",
        "vs hf",
        "greedy = hf",
    ]
    return head + "\n" + eb.table(headers, rows)


def main(args: argparse.Namespace) -> int:
    from engine.checkpoint.registry import PullError  # noqa: PLC0415
    from engine.checkpoint.registry import resolve as resolve_model  # noqa: PLC0415
    from engine.config import PRESETS, CacheConfig, is_checkpoint_dir, resolve_model_config  # noqa: PLC0415
    from engine.generate_cli import kv_dtype_of  # noqa: PLC0415
    from engine.model.attention_registry import BACKENDS, backend_by_name  # noqa: PLC0415
    from engine.model.linear import resolve_host_gemm  # noqa: PLC0415
    from engine.runner.compiled_decode import COMPILE_MODES, CompiledDecode  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415

    device = eb.resolve_device(args.device)
    batches = eb.parse_ints(args.batches, "--batches")
    hf_batches = eb.parse_ints(args.hf_batches, "--hf-batches") if args.hf_batches.strip() else []
    backends = [b.strip() for b in args.attention.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if not backends or bad:
        raise CliError(f"--attention: choose from {', '.join(BACKENDS)} (got {args.attention!r})")
    if args.prompt_len < 1 or args.new_tokens < 1:
        raise CliError("--prompt-len and --new-tokens must be >= 1")
    threads_list = (
        eb.parse_ints(args.threads, "--threads")
        if args.threads
        else [1 if device.type == "cpu" else os.cpu_count() or 1]
    )
    gemms = [g.strip() for g in args.cpu_gemm.split(",") if g.strip()]
    try:
        resolved = [resolve_host_gemm(g, args.dtype, device) for g in gemms]
    except ValueError as e:
        raise CliError(str(e)) from None
    if not gemms:
        raise CliError("--cpu-gemm: give at least one of auto, fp32, bf16")
    compiles = list(dict.fromkeys(c.strip() for c in args.compile.split(",") if c.strip()))
    if not compiles or any(c not in COMPILE_MODES for c in compiles):
        raise CliError(f"--compile: choose from {', '.join(COMPILE_MODES)} (got {args.compile!r})")
    if device.type != "cpu" and compiles != ["off"]:
        raise CliError("--compile is the CPU decode step's (CUDA steps replay CUDA graphs)")
    # Both engines run with the same explicit thread count (the ratio is only fair if both see the
    # same pool); 1 on CPU because a 2-thread pool on the shared 2-core VM oversubscribes.
    torch.set_num_threads(threads_list[0])
    try:
        model = resolve_model(args.model, progress=not args.no_progress)
    except PullError as e:
        raise CliError(str(e)) from None
    if model not in PRESETS and not is_checkpoint_dir(model):
        raise CliError(f"--model {args.model!r}: not a preset, registry model or checkpoint")
    cfg = resolve_model_config(model)
    ckpt = None if model in PRESETS else model
    total = args.prompt_len + args.new_tokens
    if total > cfg.max_position_embeddings:
        raise CliError(f"{total} tokens exceed {cfg.name}'s context of {cfg.max_position_embeddings}")
    kv_dtype = kv_dtype_of(args)
    per_seq = -(-total // 16)
    cache = CacheConfig(block_size=16, num_blocks=max(batches) * per_seq + 1, kv_dtype=kv_dtype)
    runner = ModelRunner(cfg, cache, args.dtype, device, ckpt, seed=args.seed)
    graphs: Any = None  # CUDA graphs, or a compiled CPU step per variant below
    if device.type == "cuda" and not args.enforce_eager:
        from engine.gpu.cuda_graphs import DecodeGraphRunner  # noqa: PLC0415 (CUDA only)

        graphs = DecodeGraphRunner(runner, max_context=per_seq * 16, pad_block=0)
        graphs.capture()
        runner.graphs = graphs
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (max(batches), args.prompt_len), generator=gen).tolist()
    hf = load_hf(model, device) if ckpt and hf_batches else None
    log = (lambda *a: None) if args.no_progress else (lambda *a: print("bench step:", *a, file=sys.stderr))
    rows: list[dict[str, Any]] = []
    shapes = gemm_shapes(runner.model)
    variants = [(g, t, c) for g in dict.fromkeys(resolved) for t in threads_list for c in compiles]
    for gemm, threads, comp in variants:
        runner.model.set_cpu_gemm(gemm)
        torch.set_num_threads(threads)
        weight_bytes = runner.model.decode_weight_bytes()
        for name in backends:
            runner.backend = backend_by_name(name, device)
            compile_s = None
            if comp != "off":  # the compiled step calls the C++ attention kernel, whatever the backend
                try:
                    graphs = CompiledDecode(runner, comp)
                except ValueError as e:
                    raise CliError(str(e)) from None
                compile_s = graphs.warm_up()
                runner.graphs = graphs
            elif device.type == "cpu":
                runner.graphs = None
            run_engine(runner, prompts[:2], 2)  # warm-up: allocator, kernels, first-call paths, layouts
            for B in batches:
                runner.graph_steps = 0
                row: dict[str, Any] = {
                    "attention": name,
                    "backend": type(runner.backend).__name__,
                    "cpu_gemm": gemm,
                    "threads": threads,
                    "batch": B,
                }
                if len(compiles) > 1 or comp != "off":
                    row.update(compile=comp, compile_s=compile_s)
                copy_bps, copy_bytes = eb.copy_bandwidth(device)  # this row's bandwidth: the VM is shared
                if device.type == "cpu":  # plain PyTorch on the same shapes, threads and rows, just before
                    row["torch_stack_ms"] = torch_stack_ms(shapes, B)
                row.update(run_engine(runner, prompts[:B], args.new_tokens))
                row.update(weight_floor(row["decode_step_ms"], weight_bytes, copy_bps, copy_bytes))
                row["prefill_tokens_per_s"] = B * args.prompt_len / row["prefill_steps_s"]
                # KV a median decode step reads: every row's context (prompt + about half the new tokens)
                row["kv_bytes_per_step"] = B * (args.prompt_len + args.new_tokens // 2) * runner.layout.bytes_per_token
                if hf is not None and B in hf_batches:
                    if not any("transformers" in x for x in rows):
                        run_hf(hf, prompts[:1], 2, device)  # warm-up
                    h = run_hf(hf, prompts[:B], args.new_tokens, device)
                    row["transformers"] = {k: v for k, v in h.items() if not k.startswith("_")}
                    row["speedup_vs_transformers"] = h["e2e_s"] / row["e2e_s"]
                    row["greedy_equal_transformers"] = h["_ids"] == row["_ids"]
                    row["greedy_equal_rows"] = sum(a == b for a, b in zip(h["_ids"], row["_ids"]))
                row.pop("_ids")
                key = (name, gemm, threads, comp)
                same = [x for x in rows + [row] if _variant(x) == key]
                row["decode_step_vs_first_batch"] = row["decode_step_ms"] / same[0]["decode_step_ms"]
                rows.append(row)
                if comp != "off":
                    row["compiled_steps"] = runner.graph_steps
                log(
                    f"{_label(row)} batch {B}: decode step {row['decode_step_ms']:.2f} ms, "
                    f"host {row['host_ms']:.3f} ms, floor {row['floor_ms']:.2f} ms ({row['copy_GBps']:.1f} GB/s copy)"
                )
    r: dict[str, Any] = {
        "bench": "step",
        "model": cfg.name if not ckpt else args.model,
        "dtype": args.dtype,
        "kv_dtype": kv_dtype,
        "device": str(device),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch_threads": threads_list,
        "cpu_gemm": list(dict.fromkeys(resolved)),
        "cuda_graphs": device.type == "cuda" and runner.graphs is not None,
        "load_average": eb.load_average(),
        "rows": rows,
    }
    if len(backends) > 1:  # the same batch under each backend, in this run
        base = {(x["cpu_gemm"], x["threads"], x["batch"]): x for x in rows if x["attention"] == backends[-1]}
        r["decode_step_ratio_vs_" + backends[-1]] = {
            f"{x['attention']}@{x['batch']}": base[x["cpu_gemm"], x["threads"], x["batch"]]["decode_step_ms"]
            / x["decode_step_ms"]
            for x in rows
            if x["attention"] != backends[-1]
        }
    if compiles != ["off"]:
        r["compile"] = compiles
    if len(variants) > 1:  # each variant's decode step over the first's, same backend and batch
        first = {(x["attention"], x["batch"]): x for x in rows if _variant(x)[1:] == variants[0]}
        r["decode_step_vs_first_variant"] = {
            f"{x['attention']} {x['cpu_gemm']} x{x['threads']}"
            f"{'' if x.get('compile', 'off') == 'off' else ' compile-' + x['compile']}@{x['batch']}": x[
                "decode_step_ms"
            ]
            / first[x["attention"], x["batch"]]["decode_step_ms"]
            for x in rows
        }
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    name = args.out or f"step-{Path(r['model']).name}-{device.type}"
    path = write_result(name, r, config={k: v for k, v in vars(args).items() if not callable(v)}, out_dir=out_dir)
    if args.json:
        emit_json({**r, "result": str(path)})
    else:
        print(render(r))
        print(f"results: {path}")
    return 0
