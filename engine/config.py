"""Configuration dataclasses shared by every part of pdserve.

`ModelConfig` describes a Llama-family transformer (the fields of a Hugging Face
`config.json` that matter). `CacheConfig` describes the paged KV pool. Neither imports torch,
so the router, the cost model and the simulator can use them freely.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Byte-level tokenizer ids used by randomly initialised models (see engine/checkpoint/tokenizer.py).
BYTE_VOCAB = 256
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 rope scaling ("rope_type": "llama3") as in the published 3.1 configs."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = BYTE_BOS_ID
    eos_token_id: int | None = BYTE_EOS_ID

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Exact parameter count of this architecture (norms included)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return L * per_layer + embed + head + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None and not isinstance(d["rope_scaling"], RopeScaling):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str = "hf") -> ModelConfig:
        """Build from a Hugging Face Llama `config.json` dictionary."""
        heads = hf["num_attention_heads"]
        # transformers < 5 writes "rope_scaling" + top-level "rope_theta"; transformers >= 5 writes
        # "rope_parameters" holding rope_type, the scaling fields and rope_theta together.
        params = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or params
        rope = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                rope = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
                )
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (pdserve supports 'llama3')")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):  # Llama 3.1 instruct lists several; the first is the canonical one
            eos = eos[0]
        return cls(
            name=name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope_theta=float(hf.get("rope_theta", params.get("rope_theta", 10000.0))),
            rope_scaling=rope,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face `LlamaConfig` keyword arguments."""
        d: dict[str, Any] = dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
        )
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(rope_type="llama3", **asdict(self.rope_scaling))
        return d


_LLAMA31_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama3(
    name: str,
    sizes: tuple[int, int, int, int, int],
    rope_scaling: RopeScaling = _LLAMA31_ROPE,
    tie_word_embeddings: bool = False,
) -> ModelConfig:
    """A Llama 3 shape: the family shares its vocabulary, 8 KV heads, 128k context, rope theta and
    special tokens, so only `sizes` (hidden, intermediate, layers, heads, head_dim) differ."""
    hidden, intermediate, layers, heads, head_dim = sizes
    return ModelConfig(
        name=name,
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=128000,
        eos_token_id=128001,
    )


PRESETS: dict[str, ModelConfig] = {
    # CPU tests and demo: a forward pass of a few hundred tokens takes milliseconds.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=320,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    ),
    # The Llama 3 ones below: (hidden, intermediate, layers, heads, head_dim).
    # ~1.2B, Llama-3.2-1B shapes (tied embeddings): a GPU smoke test.
    "small": _llama3("small", (2048, 8192, 16, 32, 64), RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True),
    # Exact published shapes of meta-llama/Llama-3.1-8B and -70B (config.json).
    "llama-3.1-8b": _llama3("llama-3.1-8b", (4096, 14336, 32, 32, 128)),
    "llama-3.1-70b": _llama3("llama-3.1-70b", (8192, 28672, 80, 64, 128)),
}


def resolve_model_config(model: str) -> ModelConfig:
    """A preset name, a checkpoint directory, a path to a config.json, or a .gguf file."""
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from engine.gguf_file import GGUFFile  # noqa: PLC0415 - numpy + gguf, no torch

        return ModelConfig.from_hf_config(GGUFFile(path).hf_config(), name=path.stem)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with config.json"
        )
    return ModelConfig.from_hf_config(json.loads(path.read_text()), name=path.parent.name or "hf")


KV_DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}

# CPU: a step with at least this many prompt tokens runs with the worker's prompt threads
# (WorkerConfig.prompt_threads; a server's --prompt-threads-min-tokens): its GEMMs are long enough
# that a second thread pays (SmolLM2, 2,048 prompt tokens on the 2-core dev VM: 1,049 us a token on
# 2 threads against 1,910 on 1), while a decode step's many short parallel regions stall whenever
# another process takes one of their cores (router/workers/threads.py). Why 256 and not 64: served
# beside the router streaming two dozen requests (a shared-prefix chat on the 2-core dev VM,
# 2026-12-06, serve-flags-ab-chat-prefix in benchmarks/results/plan-verify; docs/plan.md has the
# run), steps of 64-127 prompt tokens ran ~14% slower on two threads than on one, 128-255 ~4%
# faster (inside the VM's spread), 256-511 ~1.3x faster. The simulator prices such steps apart
# (costmodel/sim/model.py StepModel.prompt_fit).
PROMPT_STEP_TOKENS = 256


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens, for all layers."""

    block_size: int = 16
    num_blocks: int = 512
    kv_dtype: str = "fp8"  # fp8 (e4m3 + per-token-head fp32 scales) | bf16 | fp32

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {self.kv_dtype!r}")
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("block_size and num_blocks must be positive")


def with_overrides(cfg: Any, **kw: Any) -> Any:
    """dataclasses.replace that ignores None values (handy for CLI flags)."""
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})


def is_checkpoint_dir(model: str) -> bool:
    """Real weights, as opposed to a preset name: a Hugging Face checkpoint directory (has
    config.json; `pdserve model pull` writes one) or a .gguf file."""
    p = Path(model)
    return (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix.lower() == ".gguf")


def read_generation_eos(directory: str | Path) -> list[int]:
    """All eos ids a checkpoint declares (config.json and generation_config.json, or a GGUF's metadata)."""
    if Path(directory).is_file():  # a .gguf file
        from engine.gguf_file import GGUFFile  # noqa: PLC0415

        eos = GGUFFile(directory).hf_config()["eos_token_id"]
        return [] if eos is None else [int(eos)]
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = Path(directory) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return sorted(set(ids))


__all__ = [
    "ModelConfig",
    "RopeScaling",
    "CacheConfig",
    "PRESETS",
    "resolve_model_config",
    "KV_DTYPE_BYTES",
    "with_overrides",
    "is_checkpoint_dir",
    "read_generation_eos",
]

# An idle engine loop woken by a request gathers more before it runs a step: until none has come for
# BATCH_WAIT_S, at most BATCH_WAIT_MAX_S after the first (engine/worker_base.py; a server's
# --batch-wait-ms and --batch-wait-max-ms). Without it, requests sent together raced the loop's
# wake-up: on the 2-core dev VM four chats sent within 1.3 ms of each other ran as 1+3, 2+2 or 3+1
# prompt steps from one run to the next (21 modes of seven `bench compare` runs, 2026-12-05/06),
# their TTFT median moving ~30% with it. A fixed 2 ms window from the first still split most
# bursts where the router handed them on further apart (a VM with half the memory bandwidth: 11-13
# prompt steps for eight bursts of four, 2026-12-07); the same 2 ms restarted by each arrival took
# 9-10, a 5 ms one 8-10 but cost every lone request 3 ms more (docs/serving.md). Triton's dynamic
# batcher calls this max_queue_delay. It costs a lone request on an idle server BATCH_WAIT_S of
# TTFT, and nothing under load: a loop that has work never waits. The simulator models it
# (costmodel/sim/model.py SimConfig.batch_wait_s).
BATCH_WAIT_S = 0.002
BATCH_WAIT_MAX_S = 0.025
