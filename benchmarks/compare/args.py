"""`pdserve bench compare`'s command line: the flags, the workload they set, the modes they name.

Parsing is kept apart from running so that a bad flag fails (a one-line `CliError`) before any
server starts, and so that the defaults shown in `--help` are the ones the run uses.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from costmodel.provenance import OUT_DIR_HELP
from costmodel.workloads import WorkloadConfig

# The CPU-sized default: 8 chats decoding 400 tokens while three 2048-token documents arrive.
# On the 2-core dev machine with the tiny model a 2048-token prefill takes ~0.6 s and a decode
# step of 8 streams ~10-20 ms, so the colocated freeze stands out, and the chats (~4-6 s) are
# still decoding when the last document arrives in every mode. About a minute for all modes.
DEFAULT_WORKLOAD = dict(
    chat_streams=8,
    chat_prompt_len=64,
    chat_output_len=400,
    doc_prompt_len=2048,
    doc_output_len=8,
    doc_count=3,
    doc_start_s=1.0,
    doc_interval_s=1.2,
)
QUICK_WORKLOAD = dict(
    chat_streams=3,
    chat_prompt_len=32,
    chat_output_len=40,
    doc_prompt_len=512,
    doc_output_len=4,
    doc_count=1,
    doc_start_s=0.4,
    doc_interval_s=1.0,
)


@dataclass(frozen=True)
class ModeSpec:
    """One server configuration to measure."""

    label: str  # "colocated", "chunked-128", "disagg-1P1D"
    mode: str  # ServeConfig.mode
    chunk_size: int | None = None
    prefill: int = 1
    decode: int = 1


@dataclass(frozen=True)
class EndpointSpec:
    """A server pdserve did not start (`--endpoint NAME=URL[,model=M]`): one more row of the table."""

    label: str  # NAME
    url: str  # the OpenAI API base URL, ending in /v1
    model: str | None = None  # None: the first model the server lists at /v1/models
    calibration: str | None = None  # --endpoint-calibration NAME=FILE (a `pdserve bench probe` calibration)
    mode: str = "endpoint"  # in the result's "spec", where pdserve's rows say colocated/disagg/auto


def _ints(text: str, flag: str) -> list[int]:
    from cli import CliError  # noqa: PLC0415

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CliError(f"{flag}: expected positive integers, got {text!r}")
    return vals


def build_modes(modes: str, chunk_sizes: str, prefill: int, decode: int) -> list[ModeSpec]:
    from cli import CliError  # noqa: PLC0415

    names = [m.strip() for m in modes.split(",") if m.strip()]
    if names in ([], ["none"]):  # only the --endpoint servers
        return []
    bad = [m for m in names if m not in ("colocated", "chunked", "disagg", "auto")]
    if bad:
        raise CliError(
            f"--modes: expected a comma-separated subset of colocated,chunked,disagg,auto, or none, got {modes!r}"
        )
    if prefill < 1 or decode < 1:
        raise CliError("--prefill and --decode must be >= 1")
    out: list[ModeSpec] = []
    for m in dict.fromkeys(names):
        if m == "colocated":
            out.append(ModeSpec("colocated", "colocated", decode=decode))
        elif m == "chunked":
            out += [
                ModeSpec(f"chunked-{c}", "colocated", c, decode=decode)
                for c in dict.fromkeys(_ints(chunk_sizes, "--chunk-sizes"))
            ]
        elif m == "auto":  # both pools; local prefills in chunks of the largest --chunk-sizes
            chunk = max(_ints(chunk_sizes, "--chunk-sizes"))
            out.append(ModeSpec(f"auto-{prefill}P{decode}D", "auto", chunk, prefill, decode))
        else:
            out.append(ModeSpec(f"disagg-{prefill}P{decode}D", "disagg", None, prefill, decode))
    return out


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a row label, and part of plot file names


def parse_endpoints(given: list[str] | None, calibrations: list[str] | None, taken: set[str]) -> list[EndpointSpec]:
    """`--endpoint NAME=URL[,model=M]` and `--endpoint-calibration NAME=FILE` (both repeatable);
    `taken`: the labels of pdserve's own modes, which a NAME must not repeat."""
    from benchmarks.client.serve_client import normalize_base_url  # noqa: PLC0415
    from cli import CliError  # noqa: PLC0415

    out: dict[str, EndpointSpec] = {}
    for text in given or []:
        name, sep, rest = text.partition("=")
        url, *options = rest.split(",")
        if not sep or not _NAME.fullmatch(name.strip()) or not url.strip():
            raise CliError(f"--endpoint: expected NAME=URL[,model=M] (NAME: letters, digits, . _ -), got {text!r}")
        name = name.strip()
        if name in out or name in taken:
            raise CliError(f"--endpoint {text!r}: the name {name!r} is already a row of the table; pick another")
        try:
            url = normalize_base_url(url.strip())
        except ValueError:
            raise CliError(f"--endpoint {text!r}: the URL must start with http:// or https://") from None
        model = None
        for opt in options:
            key, sep, value = opt.partition("=")
            if key.strip() != "model" or not sep or not value.strip() or model is not None:
                raise CliError(f"--endpoint {text!r}: after the URL only one model=M is understood, got {opt!r}")
            model = value.strip()
        out[name] = EndpointSpec(name, url, model)
    for text in calibrations or []:
        name, sep, path = (x.strip() for x in text.partition("="))
        if not sep or not path:
            raise CliError(f"--endpoint-calibration: expected NAME=FILE, got {text!r}")
        if name not in out:
            raise CliError(f"--endpoint-calibration {text!r}: no --endpoint is named {name!r}")
        if not Path(path).is_file():
            raise CliError(f"--endpoint-calibration {text!r}: no such file")
        out[name] = replace(out[name], calibration=path)
    return list(out.values())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n"
        "  pdserve bench compare                          # CPU-sized default, a few minutes\n"
        "  pdserve bench compare --quick                  # CI-sized\n"
        "  pdserve bench compare --modes colocated,disagg --prefill 2 --decode 2\n"
        "  pdserve bench compare --from-json benchmarks/results/compare-tiny-cpu.json  # redraw\n"
        "  pdserve bench compare --modes colocated --endpoint vllm=http://HOST:8000,model=M  # beside vLLM\n"
        "  pdserve bench compare --modes none --endpoint a=http://HOST:8000 --endpoint b=http://HOST:8100\n"
    )
    g = p.add_argument_group("servers")
    g.add_argument(
        "--modes",
        default="colocated,chunked,disagg",
        help="pdserve servers to start, comma-separated: colocated,chunked,disagg,auto; "
        "none: start none, measure only the --endpoint servers",
    )
    g.add_argument("--chunk-sizes", default="32,128", help="one chunked run per size (tokens)")
    g.add_argument("--prefill", type=int, default=1, metavar="N", help="disagg prefill workers")
    g.add_argument("--decode", type=int, default=1, metavar="M", help="decode (and colocated) workers")
    g.add_argument(
        "--model",
        default="tiny",
        help="preset, registry model (e.g. smollm2-135m-instruct: pulled on first use; the report then "
        "shows its answers to a few questions), checkpoint directory or .gguf file",
    )
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn automatic prefix caching off in every pool (the simulator has no cache: with it on, "
        "a document sent again is neither prefilled nor pulled in full)",
    )
    g.add_argument(
        "--kv-transfer",
        default="bulk",
        choices=("bulk", "layerwise", "auto"),
        help="the disaggregated (and auto) servers' KV transfer, as `pdserve serve --kv-transfer`; "
        "the predictions model the same (default bulk)",
    )
    g.add_argument("--kv-stream-layers", type=int, default=1, metavar="N", help="as `pdserve serve --kv-stream-layers`")
    g.add_argument("--startup-timeout-s", type=float, default=300.0)
    e = p.add_argument_group("servers pdserve did not start (vLLM, SGLang, ...; recipes in docs/external.md)")
    e.add_argument(
        "--endpoint",
        action="append",
        metavar="NAME=URL[,model=M]",
        help="repeatable: one more row of the table, named NAME: the same warm-up, timed run and report "
        "against this OpenAI-compatible server (model: default the first at /v1/models). Greedy equality is "
        "checked where the server returns token ids (pdserve does) and compared as text otherwise; "
        "it never fails the run",
    )
    e.add_argument(
        "--endpoint-calibration",
        action="append",
        metavar="NAME=FILE",
        help="repeatable: the calibration `pdserve bench probe --base-url URL` wrote for that server; "
        "without one the endpoint's row has no prediction",
    )
    w = p.add_argument_group("workload (the article mix; defaults are CPU-sized)")
    for flag, key in (
        ("--chat-streams", "chat_streams"),
        ("--chat-prompt-len", "chat_prompt_len"),
        ("--chat-output-len", "chat_output_len"),
        ("--doc-prompt-len", "doc_prompt_len"),
        ("--doc-output-len", "doc_output_len"),
        ("--doc-count", "doc_count"),
    ):
        w.add_argument(
            flag, type=int, default=None, help=f"default {DEFAULT_WORKLOAD[key]} ({QUICK_WORKLOAD[key]} with --quick)"
        )
    w.add_argument(
        "--chat-stagger-s",
        type=float,
        default=None,
        help="chat i starts at i x this (default 0: all at once; chats sent in the same millisecond race "
        "for the first prefill step, so which of them share it varies run to run)",
    )
    w.add_argument("--doc-rate", type=float, default=None, help="documents/s, Poisson (default: fixed spacing)")
    w.add_argument("--doc-start-s", type=float, default=None, help=f"default {DEFAULT_WORKLOAD['doc_start_s']}")
    w.add_argument("--doc-interval-s", type=float, default=None, help=f"default {DEFAULT_WORKLOAD['doc_interval_s']}")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--quick", action="store_true", help="tiny CI-sized workload (one short document)")
    c = p.add_argument_group("on a cluster (e.g. `pdserve cluster up`; see docs/cluster.md)")
    c.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: a local one)")
    c.add_argument("--prefill-resources", default=None, metavar="JSON", help="as `pdserve serve`")
    c.add_argument("--decode-resources", default=None, metavar="JSON", help="as `pdserve serve`")
    c.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        metavar="G",
        help="the link between the pools: predictions price the KV at G Gbit/s, and each document "
        "is probed alone (TTFT, time to 2nd token, decode wait, transfer, share of TTST)",
    )
    o = p.add_argument_group("SLO, predictions and output")
    o.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="TTFT SLO for goodput (default: derived from the calibration, 2x a document's predicted "
        "prefill alone plus the serving hop; the report prints the SLOs used)",
    )
    o.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="TPOT SLO for goodput (default: derived from the calibration, 1.5x the predicted decode "
        "step of the workload's chat streams)",
    )
    o.add_argument(
        "--calibration",
        default=None,
        help="cost-model calibration JSON that predicts every mode (default: each mode is predicted "
        "from its own server's warm-up steps, or from <out-dir>/chunks-<model>-<device>.calibration.json "
        "of `pdserve bench chunks` where that predicted the warm-up better)",
    )
    o.add_argument(
        "--transfer-from",
        default=None,
        metavar="RESULT",
        help="predict each mode from an earlier `bench compare` result's fits to that mode's server "
        "(its warm-up steps, decode admission and serving hop) instead of this run's warm-up: transfer "
        "accuracy, a workload predicted from a run of another (the default is replay: this schedule's warm-up)",
    )
    o.add_argument(
        "--probe-calibration",
        action="store_true",
        help="also calibrate each mode with `pdserve bench probe --quick` of its server (about a minute "
        "more per mode): a third candidate beside the server's own warm-up steps and the calibration file",
    )
    o.add_argument("--duration-limit-s", type=float, default=300.0, help="per timed run")
    o.add_argument("--out", default=None, help="result name (default compare-<model>-<device>)")
    o.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    o.add_argument("--json", action="store_true", help="print the result summary as JSON instead of the table")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument(
        "--from-json",
        default=None,
        metavar="RESULT",
        help="redraw the report and plots from an earlier result JSON (no servers)",
    )


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    base: dict[str, Any] = dict(QUICK_WORKLOAD if args.quick else DEFAULT_WORKLOAD)  # int and float fields
    for key in (
        "chat_streams",
        "chat_prompt_len",
        "chat_output_len",
        "doc_prompt_len",
        "doc_output_len",
        "doc_count",
        "doc_start_s",
        "doc_interval_s",
        "chat_stagger_s",
    ):
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    return WorkloadConfig(workload="article", seed=args.seed, doc_rate=args.doc_rate, **base)
