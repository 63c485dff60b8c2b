"""Every `--json` command writes exactly one JSON document to stdout (`pdserve ... --json | jq`).

Each command runs as a real process through the console script, the way a user pipes it, and
stdout must parse with `json.loads` as a whole: no NIXL/UCX/Ray log line, progress bar or trailing
"result: ..." line may reach it (they belong on stderr). The first test keeps this list complete:
a new command with `--json` fails it until it is added here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli import BENCH_COMMANDS, COMMANDS, build_parser
from tests.fakes import FakeCompletionsServer, FakeScript

# `pdserve` child processes
pytestmark = [pytest.mark.server]

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_COMPARE = ROOT / "benchmarks/results/compare-tiny-cpu.json"
ENGINE = ["--model", "tiny", "--device", "cpu", "--no-progress", "--threads", "1"]

REPO = Path(__file__).resolve().parent.parent
# command words -> extra arguments (a tiny, fast configuration); {tmp} is a scratch directory, {repo}
# the checkout
CASES: dict[tuple[str, ...], list[str]] = {
    ("cost",): ["--config", "llama-3.1-70b"],
    ("simulate",): ["--duration", "6", "--warmup", "1", "--doc-rate", "0.5", "--no-png", "--out-dir", "{tmp}"],
    ("plan",): ["--gpu", "h100", "--model", "llama-3.1-70b", "--workers", "2"],
    ("generate",): ["--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--temperature", "0"],
    ("model", "list"): [],
    ("bench", "transfer"): [
        "--size-mb",
        "1",
        "--block-tokens",
        "16",
        "--repeats",
        "1",
        "--no-plot",
        "--out-dir",
        "{tmp}",
    ],
    ("bench", "chunks"): [
        *ENGINE,
        "--decode-batch",
        "2",
        "--context",
        "32",
        "--prompt-len",
        "64",
        "--chunks",
        "32",
        "--repeats",
        "1",
        "--decode-repeats",
        "1",
        "--out-dir",
        "{tmp}",
    ],
    ("bench", "article"): [
        *ENGINE,
        "--batches",
        "1",
        "--ctx",
        "32",
        "--contexts",
        "32",
        "--decode-repeats",
        "1",
        "--prefill-repeats",
        "1",
        "--out-dir",
        "{tmp}",
    ],
    ("bench", "step"): [
        *ENGINE,
        "--batches",
        "1,2",
        "--prompt-len",
        "8",
        "--new-tokens",
        "3",
        "--attention",
        "batched,reference",
        "--out-dir",
        "{tmp}",
    ],
    # against a scripted OpenAI-compatible server (tests/fakes.py); the real server is covered by
    # `bench compare` in test_bench_compare.py
    ("bench", "serve"): [
        "--base-url",
        "{server}",
        "--num-requests",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
        "--no-progress",
        "--results-dir",
        "{tmp}",
    ],
    # the quick probe against the scripted server (the real server: test_bench_probe.py)
    ("bench", "probe"): [
        "--base-url",
        "{server}",
        "--quick",
        "--max-context",
        "256",
        "--no-plot",
        "--out-dir",
        "{tmp}",
    ],
    # the capacity part only, on a tiny pool (the multi-turn part starts real servers: bench runs it)
    ("bench", "kvcache"): [
        "--part",
        "capacity",
        "--requests",
        "4",
        "--num-blocks",
        "24",
        "--max-tokens",
        "64",
        "--output-min",
        "8",
        "--output-max",
        "16",
        "--out-dir",
        "{tmp}",
    ],
    # the real model (pulled once per machine), one setting, a few tokens, no transformers reference
    ("bench", "quality"): ["--tokens", "16", "--settings", "fp32", "--no-transformers", "--out-dir", "{tmp}"],
    # a saved run summarized again (the live benchmark needs a disaggregated server)
    ("bench", "layerwise"): ["--from-json", "{repo}/benchmarks/results/layerwise-1g.json", "--out-dir", "{tmp}"],
    # a real server for 12 s of load, no fault (its faults are tests/test_faults.py's)
    ("bench", "soak"): [
        "--minutes",
        "0.1",
        "--fault-interval-s",
        "600",
        "--prefill",  # 1P1D: the smallest disaggregated server (4 workers took ~15 s more to start)
        "1",
        "--decode",
        "1",
        "--concurrency",
        "2",
        "--max-tokens",
        "8",
        "--no-plot",
        "--out-dir",
        "{tmp}",
    ],
    # two variants of a few short prefills, each in its own child process
    ("bench", "rss-shapes"): ["--prompts", "3", "--max-len", "40", "--variants", "fixed,buckets", "--out-dir", "{tmp}"],
    # redraws the committed reference result (the measured run itself is test_bench_compare.py's)
    ("bench", "compare"): ["--from-json", str(REFERENCE_COMPARE), "--out-dir", "{tmp}"],
}


# --json commands whose one-document stdout is checked in their own test module, where the state
# they need exists: `cluster up` builds (and `cluster down` removes) a root-only namespace cluster.
COVERED_ELSEWHERE: dict[tuple[str, ...], str] = {
    ("cluster", "up"): "tests/test_cluster.py: the module's cluster fixture parses its stdout",
    ("cluster", "down"): "tests/test_cluster.py::test_down_leaves_nothing parses its stdout",
}


def _json_commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    found = {words} if any("--json" in a.option_strings for a in parser._actions) else set()
    for action in parser._actions:
        if isinstance(action.choices, dict):  # a subparsers action: {command: its parser}
            for name, sub in action.choices.items():
                if isinstance(sub, argparse.ArgumentParser):
                    found |= _json_commands(sub, (*words, name))
    return found


def test_every_json_command_is_covered():
    found: set[tuple[str, ...]] = set()
    for name in COMMANDS:
        found |= {c for c in _json_commands(build_parser([name])) if c[:1] == (name,)}
    for name in BENCH_COMMANDS:
        found |= {c for c in _json_commands(build_parser(["bench", name])) if c[:2] == ("bench", name)}
    known = set(CASES) | set(COVERED_ELSEWHERE)
    assert found == known, f"add the missing --json commands to CASES: {found ^ known}"


@pytest.fixture(scope="module")
def server():
    with FakeCompletionsServer(FakeScript()) as srv:
        yield srv


def _pdserve() -> list[str]:
    script = Path(sys.executable).with_name("pdserve")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cli"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("words", list(CASES), ids=" ".join)
def test_json_stdout_is_one_document(words, tmp_path, server):
    """Cost: each case is a real `pdserve ... --json` child process (Python, torch, the command's own short
    run): stdout is the thing tested."""
    args = [a.format(tmp=tmp_path, server=server.base_url, repo=REPO) for a in CASES[words]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*_pdserve(), *words, *args, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        pytest.fail(
            f"stdout of `pdserve {' '.join(words)} --json` is not one JSON document ({e}):\n{proc.stdout[:2000]}"
        )
