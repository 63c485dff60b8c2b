"""The published figures the cost model prices with: GPU datasheets, the article's links, model
shapes, and the article's own setting (Llama-3.1-70B on an H100 SXM at 40% MFU).

Figures here are as the vendors print them. A measured device replaces them through a calibration
(`costmodel/fit/calibration.py`); the arithmetic (`costmodel/article/cost_model.py`) only reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.config import PRESETS, ModelConfig, resolve_model_config

GB = 1e9
TFLOP = 1e12


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    mem_bw: float  # bytes/s
    peak_flops: dict[str, float]  # dense FLOP/s per compute dtype
    mem_bytes: float  # HBM capacity
    source: str
    step_overhead_s: float = 0.0  # per decode step (from a calibration)
    prefill_overhead_s: float = 0.0  # per prefill or chunk (from a calibration)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no dense {dtype} peak (has: {', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]


HARDWARE: dict[str, HardwareSpec] = {
    "h100-sxm": HardwareSpec(
        "h100-sxm",
        3.35e12,
        {"fp8": 1979e12, "bf16": 989e12},
        80e9,
        "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 1,979 TFLOP/s dense FP8 (3,958 with sparsity)",
    ),
    "h200": HardwareSpec(
        "h200",
        4.8e12,
        {"fp8": 1979e12, "bf16": 989e12},
        141e9,
        "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 141 GB, same Hopper tensor cores as H100 SXM",
    ),
    "b200": HardwareSpec(
        "b200",
        8.0e12,
        {"fp8": 4500e12, "bf16": 2250e12},
        180e9,
        "NVIDIA DGX B200 datasheet per GPU: 8 TB/s HBM3e, 4.5 PFLOP/s dense FP8, 2.25 dense BF16",
    ),
    "a100-80g": HardwareSpec(
        "a100-80g",
        2.039e12,
        {"bf16": 312e12},
        80e9,
        "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e, 312 TFLOP/s dense BF16, no FP8",
    ),
}
HARDWARE["h100"] = HARDWARE["h100-sxm"]
HARDWARE["a100"] = HARDWARE["a100-80g"]


@dataclass(frozen=True)
class Link:
    name: str
    label: str
    bw: float  # bytes/s


LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", "NVLink 900 GB/s", 900 * GB),
    "ib-400g": Link("ib-400g", "400G InfiniBand", 50 * GB),
    "ib-100g": Link("ib-100g", "100G InfiniBand", 12.5 * GB),
}


def resolve_hardware(name: str) -> HardwareSpec:
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name]


def resolve_link(name: str) -> Link:
    """A preset name, or NAME=GBPS for a custom link (e.g. roce=25)."""
    if "=" in name:
        label, gbps = name.split("=", 1)
        return Link(label, f"{label} {float(gbps):g} GB/s", float(gbps) * GB)
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; presets: {', '.join(LINKS)} (or NAME=GBPS)")
    return LINKS[name]


@dataclass(frozen=True)
class ModelSpec:
    """What the arithmetic needs from a transformer config."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelSpec:
        return cls(cfg.name, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.num_params()))

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str = "hf") -> ModelSpec:
        return cls.from_config(ModelConfig.from_hf_config(hf, name=name))

    @classmethod
    def resolve(cls, model: str) -> ModelSpec:
        """A preset name, a registry model already pulled (e.g. smollm2-135m-instruct), a checkpoint
        directory or a config.json path."""
        from engine.checkpoint.registry import PullError  # noqa: PLC0415
        from engine.checkpoint.registry import resolve as registry_resolve  # noqa: PLC0415

        try:
            return cls.from_config(resolve_model_config(registry_resolve(model, pull_missing=False)))
        except KeyError as e:
            raise ValueError(f"{model}: config.json lacks {e} (a Llama-family config is expected)") from None
        except (PullError, FileNotFoundError) as e:
            raise ValueError(str(e)) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{model}: not valid JSON ({e})") from None


ARTICLE_MODEL = ModelSpec.from_config(PRESETS["llama-3.1-70b"])
ARTICLE_HW = HARDWARE["h100-sxm"]
ARTICLE_MFU = 0.4

__all__ = [
    "GB",
    "TFLOP",
    "HardwareSpec",
    "HARDWARE",
    "Link",
    "LINKS",
    "resolve_hardware",
    "resolve_link",
    "ModelSpec",
    "ARTICLE_MODEL",
    "ARTICLE_HW",
    "ARTICLE_MFU",
]
