"""`pdserve` command line: one subcommand per module, imported only when used.

This module sits above every package and imports none of them at load time (only by name, for
the subcommand being run), so any layer may raise `CliError` without an import cycle.

Each module named below exposes `add_arguments(parser)` and `main(args) -> int`, so a
subcommand's heavy imports (torch, ray, fastapi) cost nothing to the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from cli.output import stdout_reserved_for_json

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.generate_cli", "generate tokens from one prompt with the local engine"),
    "serve": ("router.serve_cli", "serve an OpenAI-compatible API from prefill/decode pools"),
    "cost": ("costmodel.cost_cli", "the article's arithmetic: decode/prefill/chunk/capacity/link tables"),
    "model": ("engine.model_cli", "real models: pull (fetch + verify + convert), path, list"),
    "simulate": ("costmodel.simulate", "discrete-event simulation of colocated vs disaggregated serving"),
    "plan": ("benchmarks.plan_verify", "the deployment to run for a workload and its SLOs, ranked by simulation"),
    "cluster": ("cluster.cluster_cli", "rehearse a multi-node cluster in network namespaces (root): up/down/exec/kill"),
}

# `pdserve bench NAME`
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "transfer": ("benchmarks.transfer.transfer", "KV transfer sweep: backends, sizes, block sizes, coalescing"),
    "layerwise": (
        "benchmarks.transfer.layerwise",
        "layer-wise vs bulk KV transfer on one disaggregated server: exposed transfer, TTFT, predictions",
    ),
    "serve": ("benchmarks.client.bench_serve", "OpenAI-API load generator with TTFT/TPOT/ITL/stall metrics"),
    "probe": (
        "benchmarks.probe.command",
        "fit the article's prefill tax to any OpenAI-compatible server, from outside (calibration + tables)",
    ),
    "compare": ("benchmarks.compare.command", "colocated vs chunked vs disaggregated on the same workload"),
    "chunks": ("benchmarks.engine.chunks", "prefill throughput and decode ITL against prefill chunk size"),
    "article": ("benchmarks.engine.article", "measure the article's decode and prefill tables on this device"),
    "quality": (
        "benchmarks.engine.quality",
        "real-model perplexity and greedy agreement: fp32/bf16/FP8 vs transformers",
    ),
    "kvcache": (
        "benchmarks.engine.kvcache",
        "KV cache manager: capacity on demand vs reserved; multi-turn 2P2D with prefix caching + routing",
    ),
    "step": ("benchmarks.engine.step", "engine step split into host and forward time, beside transformers generate"),
    "gpu": ("benchmarks.gpu.bench_gpu", "GPU ceilings, decode/prefill vs roofline, transformers baseline"),
    "soak": ("benchmarks.soak.soak", "minutes of real-shaped load while workers are SIGKILLed: ok/hung, leaks, RSS"),
    "rss-shapes": (
        "benchmarks.soak.rss_shapes",
        "worker RSS over prefills of ever new lengths, each suspect (oneDNN caches, malloc) off in turn",
    ),
}


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _add(
    add_parser: Callable[..., argparse.ArgumentParser], name: str, module: str, help_: str, argv: list[str]
) -> None:
    p = add_parser(name, help=help_, description=help_)
    # Import a module only for the subcommand being run (or for its --help).
    if name in argv:
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving: engine, router, transport, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        _add(sub.add_parser, name, module, help_, argv[:1])
    bench = sub.add_parser(
        "bench", help="benchmarks (transfer, serve, probe, compare, chunks, article, step, gpu, soak)"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    for name, (module, help_) in BENCH_COMMANDS.items():
        _add(bench_sub.add_parser, name, module, help_, argv[1:2] if argv[:1] == ["bench"] else [])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "_main"):  # private-ok: the default _add sets on this parser, not another module's
        parser.print_help()
        return 2
    try:
        if getattr(args, "json", False):  # stdout is the JSON document's alone (cli/output.py)
            with stdout_reserved_for_json():
                return int(args._main(args) or 0)
        return int(args._main(args) or 0)
    except CliError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
