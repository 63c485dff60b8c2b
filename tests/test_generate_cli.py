"""`pdserve generate`: error paths (one clear line on stderr, exit 2) and run-to-run determinism.

Error paths run in-process through cli.main (the console script's entry point); only
the determinism check and one error path spawn real processes (each costs ~2 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli import main as cli_main
from tests.conftest import hf_test_config

# `pdserve` child processes
pytestmark = [pytest.mark.server]

ROOT = Path(__file__).resolve().parent.parent
TINY_CMD = [
    "generate",
    "--model",
    "tiny",
    "--prompt-ids",
    "1,2,3",
    "--max-tokens",
    "16",
    "--temperature",
    "0",
    "--json",
]


def _pdserve() -> list[str]:
    script = Path(sys.executable).with_name("pdserve")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cli"]


def _run_error(capsys, argv: list[str]) -> str:
    rc = cli_main(argv)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert rc == 2, cap.err
    assert len(lines) == 1 and lines[0].startswith("pdserve generate: error: "), cap.err
    assert cap.out == ""
    return lines[0]


@pytest.fixture()
def broken_dirs(tmp_path) -> dict[str, Path]:
    """Checkpoint directories that are wrong in one way each."""
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    not_llama = tmp_path / "not_llama"
    not_llama.mkdir()
    (not_llama / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(hf_test_config(tied=False).to_hf_config()))
    return {"bad_json": bad_json, "not_llama": not_llama, "no_weights": no_weights}


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "/no/such/dir", "--prompt-ids", "1"], "not a preset"),
        (["--model", "tiny", "--prompt-ids", "1,two,3"], "comma-separated integers"),
        (["--model", "tiny", "--prompt-ids", "1,320"], "[0, 320)"),  # tiny's vocab is 320
        (["--model", "tiny", "--prompt-ids", "-1"], "[0, 320)"),
        (["--model", "tiny", "--prompt-ids", ","], "at least one"),
        (["--model", "tiny", "--prompt-ids", ",".join(["7"] * 4096)], "context of 4096"),
        (["--model", "tiny", "--prompt", "hi", "--max-tokens", "4095"], "context of 4096"),
        (["--model", "tiny", "--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--model", "tiny", "--prompt-ids", "1", "--top-p", "0"], "top_p"),
        (["--model", "tiny", "--prompt", ""], "empty"),
    ],
    ids=[
        "missing-dir",
        "bad-ids",
        "id-out-of-vocab",
        "negative-id",
        "no-ids",
        "prompt-too-long",
        "prompt-plus-max-tokens-too-long",
        "max-tokens-0",
        "top-p-0",
        "empty-prompt",
    ],
)
def test_error_paths(capsys, argv, needle):
    assert needle in _run_error(capsys, ["generate", *argv])


@pytest.mark.parametrize(
    "kind,needle", [("bad_json", "config.json"), ("not_llama", "config.json"), ("no_weights", "safetensors")]
)
def test_broken_checkpoint_dirs(capsys, broken_dirs, kind, needle):
    assert needle in _run_error(capsys, ["generate", "--model", str(broken_dirs[kind]), "--prompt-ids", "1,2"])


def test_text_prompt_json_shape(capsys):
    assert cli_main(["generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 5 and out["dtype"] == "fp8" and out["kv_dtype"] == "fp8"  # byte tokenizer
    assert 1 <= len(out["token_ids"]) <= 4 and isinstance(out["text"], str)
    assert out["timings"]["prefill_ms"] > 0


def test_same_ids_every_run_in_fresh_processes(capsys):
    """The issue's "Done when": the tiny greedy command returns the same ids every run, and
    the same ids as the in-process entry point."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    runs = []
    for _ in range(2):
        p = subprocess.run([*_pdserve(), *TINY_CMD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout)["token_ids"])
    assert cli_main(TINY_CMD) == 0
    in_process = json.loads(capsys.readouterr().out)["token_ids"]
    assert runs[0] == runs[1] == in_process
    assert 1 <= len(in_process) <= 16 and all(0 <= t < 320 for t in in_process)


def test_error_exit_status_of_the_real_process():
    p = subprocess.run(
        [*_pdserve(), "generate", "--model", "/no/such/dir", "--prompt-ids", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "not a preset" in p.stderr
