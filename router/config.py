"""`ServeConfig`: everything `pdserve serve` needs, from CLI flags or a YAML file.

One dataclass, built in one place (`ServeConfig.build`), validated in one place (`validate`), so the
router, the pool launcher and the benchmarks all read the same names. YAML keys are the field
names (dashes allowed: `max-queue` == `max_queue`); flags given on the command line win over YAML.
The fields themselves, with their defaults and flags, are router/config_fields.py's
(`ServeSettings`); the checks, router/config_checks.py's.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from contracts.worker import WorkerConfig
from engine.checkpoint.registry import MODELS
from engine.config import PRESETS
from router.config_checks import ConfigError, check_settings
from router.config_fields import ServeSettings

__all__ = ["ConfigError", "ServeConfig", "load_yaml"]


class ServeConfig(ServeSettings):
    """The serve settings (every field is `ServeSettings`'), built from flags and YAML, checked,
    and read by the router, the pool launcher and the benchmarks. No fields of its own, so it is a
    plain subclass: the dataclass's __init__, repr and equality serve it as they are."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, flags: dict[str, Any] | None = None, yaml_path: str | Path | None = None) -> ServeConfig:
        """YAML (if any) then flags on top; a flag whose value is None was not given."""
        values: dict[str, Any] = {}
        if yaml_path is not None:
            values.update(load_yaml(yaml_path))
        names = {f.name for f in fields(cls)}
        for key, value in (flags or {}).items():
            if value is None:
                continue
            if key not in names:
                raise ConfigError(f"unknown setting {key!r}")
            values[key] = value
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        check_settings(self)

    # ------------------------------------------------------------------ views
    @property
    def model_name(self) -> str:
        """The name clients send as `model` (and /v1/models lists)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model in PRESETS or self.model in MODELS:
            return self.model
        p = Path(self.model).resolve()
        return p.stem if p.suffix.lower() == ".gguf" else p.name

    def accepted_model_names(self) -> set[str]:
        return {self.model_name, self.model}

    def resources_per_worker(self, role: str) -> list[dict[str, float]]:
        """The Ray custom resources of each worker of a pool ("prefill" or "decode")."""
        value = self.prefill_resources if role == "prefill" else self.decode_resources
        size = self.prefill if role == "prefill" else self.decode
        return [dict(v) for v in value] if isinstance(value, list) else [dict(value) for _ in range(size)]

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model=self.model,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            device=self.device,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            chunk_size=self.chunk_size,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            gemm_row_buckets=self.gemm_row_buckets,
            cpu_gemm=self.cpu_gemm,
            compile=self.compile,
            torch_threads=self.threads_per_worker,  # None (auto) until router/launch.py resolves it
            prompt_threads=self.prompt_threads,  # likewise
            prompt_threads_min_tokens=self.prompt_threads_min_tokens,
            batch_wait_s=self.batch_wait_ms / 1e3,
            batch_wait_max_s=self.batch_wait_max_ms / 1e3,
            lease_s=self.lease_s,
            transport=self.transport,
            transfer_timeout_s=self.transfer_timeout_s,
            enable_prefix_caching=self.prefix_cache,
            verify_kv=self.verify_kv,
        )

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if redact and d["api_key"]:
            d["api_key"] = "***"
        return d


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config; keys are ServeConfig fields (dashes or underscores)."""
    import yaml  # noqa: PLC0415

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {str(path)!r}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {str(path)!r}: expected a mapping of settings, got {type(data).__name__}")
    names = {f.name for f in fields(ServeConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm not in names:
            raise ConfigError(f"--config {str(path)!r}: unknown key {key!r} (known: {', '.join(sorted(names))})")
        out[norm] = value
    return out
