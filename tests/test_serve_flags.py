"""`pdserve serve`'s flags, generated from ServeConfig's fields: a snapshot of every flag (names,
action, type, choices, metavar, group) so that generating them can never quietly change the CLI,
and the rules that tie a field to its flag (every field has one, help from the field's doc)."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest

from router.config import ServeConfig

POOLS, AUTO, ROUTER, OBS, OPTIONS = "pools", "auto mode (per-request dispatch)", "router", "observability", "options"
FP8_BF16_FP32 = ("fp8", "bf16", "fp32")
LOG_LEVELS = ("debug", "info", "warning", "error")
COMPILE_MODES = ("auto", "off", "default", "max-autotune")

# flag -> (dest, action, default, type, choices, const, metavar, group): `pdserve serve --help` as it
# was when the flags were still written by hand. Every settings flag defaults to None, so that a flag
# not given does not override the YAML file.
SNAPSHOT = {
    ("-h", "--help"): ("help", "_HelpAction", "==SUPPRESS==", None, None, None, None, OPTIONS),
    ("--mode",): ("mode", "_StoreAction", None, None, ("disagg", "colocated", "auto"), None, None, POOLS),
    ("--model",): ("model", "_StoreAction", None, None, None, None, None, POOLS),
    ("--dtype",): ("dtype", "_StoreAction", None, None, FP8_BF16_FP32, None, None, POOLS),
    ("--kv-dtype",): ("kv_dtype", "_StoreAction", None, None, FP8_BF16_FP32, None, None, POOLS),
    ("--device",): ("device", "_StoreAction", None, None, None, None, None, POOLS),
    ("--prefill",): ("prefill", "_StoreAction", None, "int", None, None, "N", POOLS),
    ("--decode",): ("decode", "_StoreAction", None, "int", None, None, "M", POOLS),
    ("--chunk-size",): ("chunk_size", "_StoreAction", None, "int", None, None, "TOKENS", POOLS),
    ("--policy",): ("policy", "_StoreAction", None, None, ("round_robin", "least_loaded", "prefix"), None, None, POOLS),
    ("--gpus-per-worker",): ("gpus_per_worker", "_StoreAction", None, "float", None, None, None, POOLS),
    ("--num-blocks",): ("num_blocks", "_StoreAction", None, "int", None, None, None, POOLS),
    ("--block-size",): ("block_size", "_StoreAction", None, "int", None, None, None, POOLS),
    ("--no-prefix-cache",): ("prefix_cache", "_StoreConstAction", None, None, None, False, None, POOLS),
    ("--max-num-seqs",): ("max_num_seqs", "_StoreAction", None, "int", None, None, None, POOLS),
    ("--enforce-eager",): ("enforce_eager", "_StoreTrueAction", None, None, None, True, None, POOLS),
    ("--cpu-gemm",): ("cpu_gemm", "_StoreAction", None, None, ("auto", "fp32", "bf16"), None, None, POOLS),
    ("--compile",): ("compile", "_StoreAction", None, None, COMPILE_MODES, None, None, POOLS),
    ("--gemm-row-buckets",): ("gemm_row_buckets", "_StoreAction", None, "int", None, None, "N", POOLS),
    ("--threads-per-worker",): ("threads_per_worker", "_StoreAction", None, None, None, None, "N|auto", POOLS),
    ("--prompt-threads",): ("prompt_threads", "_StoreAction", None, None, None, None, "N|auto", POOLS),
    ("--prompt-threads-min-tokens",): (
        "prompt_threads_min_tokens", "_StoreAction", None, "int", None, None, "N", POOLS,
    ),  # fmt: skip
    ("--rss-growth-warn-mb",): ("rss_growth_warn_mb", "_StoreAction", None, "float", None, None, "MB", POOLS),
    ("--rss-warmup-steps",): ("rss_warmup_steps", "_StoreAction", None, "int", None, None, "N", POOLS),
    ("--transport",): ("transport", "_StoreAction", None, None, ("nixl", "local"), None, None, POOLS),
    ("--kv-transfer",): ("kv_transfer", "_StoreAction", None, None, ("bulk", "layerwise", "auto"), None, None, POOLS),
    ("--kv-stream-layers",): ("kv_stream_layers", "_StoreAction", None, "int", None, None, "N", POOLS),
    ("--lease-s",): ("lease_s", "_StoreAction", None, "float", None, None, None, POOLS),
    ("--batch-wait-ms",): ("batch_wait_ms", "_StoreAction", None, "float", None, None, None, POOLS),
    ("--batch-wait-max-ms",): ("batch_wait_max_ms", "_StoreAction", None, "float", None, None, None, POOLS),
    ("--transfer-timeout-s",): ("transfer_timeout_s", "_StoreAction", None, "float", None, None, None, POOLS),
    ("--prefill-resources",): ("prefill_resources", "_StoreAction", None, None, None, None, "JSON", POOLS),
    ("--decode-resources",): ("decode_resources", "_StoreAction", None, None, None, None, "JSON", POOLS),
    ("--link-gbps",): ("link_gbps", "_StoreAction", None, "float", None, None, "G", POOLS),
    ("--verify-kv", "--no-verify-kv"): ("verify_kv", "BooleanOptionalAction", None, None, None, None, None, POOLS),
    ("--ray-address",): ("ray_address", "_StoreAction", None, None, None, None, None, POOLS),
    ("--slo-ttft-ms",): ("slo_ttft_ms", "_StoreAction", None, "float", None, None, None, AUTO),
    ("--slo-itl-ms",): ("slo_itl_ms", "_StoreAction", None, "float", None, None, None, AUTO),
    ("--calibration",): ("calibration", "_StoreAction", None, None, None, None, "FILE", AUTO),
    ("--host",): ("host", "_StoreAction", None, None, None, None, None, ROUTER),
    ("--port",): ("port", "_StoreAction", None, "int", None, None, None, ROUTER),
    ("--api-key",): ("api_key", "_StoreAction", None, None, None, None, None, ROUTER),
    ("--max-queue",): ("max_queue", "_StoreAction", None, "int", None, None, None, ROUTER),
    ("--max-tokens-limit",): ("max_tokens_limit", "_StoreAction", None, "int", None, None, None, ROUTER),
    ("--shutdown-timeout-s",): ("shutdown_timeout_s", "_StoreAction", None, "float", None, None, None, ROUTER),
    ("--served-model-name",): ("served_model_name", "_StoreAction", None, None, None, None, None, ROUTER),
    ("--otlp-endpoint",): ("otlp_endpoint", "_StoreAction", None, None, None, None, "URL", OBS),
    ("--config",): ("config", "_StoreAction", None, None, None, None, "YAML", OPTIONS),
    ("--log-level",): ("log_level", "_StoreAction", "info", None, LOG_LEVELS, None, None, OPTIONS),
    ("--log-format",): ("log_format", "_StoreAction", "text", None, ("text", "json"), None, None, OPTIONS),
}  # fmt: skip


def serve_parser() -> argparse.ArgumentParser:
    """What `pdserve serve` adds to its parser (the CLI gives it this module's add_arguments)."""
    from router.serve_cli import add_arguments

    p = argparse.ArgumentParser(prog="pdserve serve")
    add_arguments(p)
    return p


def described(p: argparse.ArgumentParser) -> dict[tuple[str, ...], tuple]:
    group_of = {id(a): g.title for g in p._action_groups for a in g._group_actions}
    return {
        tuple(a.option_strings): (
            a.dest,
            type(a).__name__,
            a.default,
            getattr(a.type, "__name__", a.type),
            tuple(a.choices) if a.choices is not None else None,
            a.const,
            a.metavar,
            group_of.get(id(a)),
        )
        for a in p._actions
    }


def test_serve_flags_match_the_snapshot():
    got = described(serve_parser())
    assert got.keys() == SNAPSHOT.keys()
    for flag, want in SNAPSHOT.items():
        assert got[flag] == want, flag


def test_groups_keep_their_order():
    titles = [g.title for g in serve_parser()._action_groups]
    assert titles[-4:] == [POOLS, AUTO, ROUTER, OBS]


def test_every_setting_has_a_flag_with_help():
    p = serve_parser()
    by_dest = {a.dest: a for a in p._actions}
    for f in fields(ServeConfig):
        assert f.name in by_dest, f"ServeConfig.{f.name} has no flag"
        assert (by_dest[f.name].help or "").strip(), f"--{f.name} has no help"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--mode", "colocated", "--chunk-size", "128"], {"mode": "colocated", "chunk_size": 128}),
        (["--no-prefix-cache", "--enforce-eager"], {"prefix_cache": False, "enforce_eager": True}),
        (["--verify-kv"], {"verify_kv": True}),
        (["--no-verify-kv"], {"verify_kv": False}),
        (["--lease-s", "5", "--link-gbps", "1"], {"lease_s": 5.0, "link_gbps": 1.0}),
        (["--batch-wait-ms", "0"], {"batch_wait_ms": 0.0}),
        (["--batch-wait-max-ms", "10"], {"batch_wait_max_ms": 10.0}),
        (
            ["--prefill-resources", '{"node1": 1}', "--decode", "2", "--decode-resources", '[{"a": 1}, {"b": 2}]'],
            {"prefill_resources": {"node1": 1}, "decode": 2, "decode_resources": [{"a": 1}, {"b": 2}]},
        ),
    ],
)
def test_flags_become_settings(argv, want):
    from cli import build_parser
    from router.serve_cli import config_from_args

    cfg = config_from_args(build_parser(["serve", *argv]).parse_args(["serve", *argv]))
    assert {k: getattr(cfg, k) for k in want} == want
    untouched = ServeConfig()
    assert all(getattr(cfg, f.name) == getattr(untouched, f.name) for f in fields(cfg) if f.name not in want)


def test_bad_json_names_the_flag():
    from cli import CliError, build_parser
    from router.serve_cli import config_from_args

    argv = ["serve", "--decode-resources", "{nope"]
    with pytest.raises(CliError, match=re.escape("--decode-resources '{nope': not valid JSON")):
        config_from_args(build_parser(argv).parse_args(argv))


def test_help_shows_the_defaults():
    text = " ".join(serve_parser().format_help().split())  # as one line, whatever the terminal's width
    d = ServeConfig()
    for needle in (
        f"(default {d.mode})",
        f"(default {d.max_queue})",
        f"(default {d.lease_s:g})",
        "(default text)",
        "--no-prefix-cache",
    ):
        assert needle in text, needle


def test_in_process_server_still_imports_from_serve_cli():
    from router import serve_cli, server_thread

    assert serve_cli.ServerThread is server_thread.ServerThread
    assert serve_cli.start_server_in_thread is server_thread.start_server_in_thread
