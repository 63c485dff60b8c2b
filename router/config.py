"""`ServeConfig`: everything `pdserve serve` needs, from CLI flags or a YAML file.

One dataclass, built in one place (`ServeConfig.build`), validated in one place (`validate`), so the
router, the pool launcher and the benchmarks all read the same names. YAML keys are the field
names (dashes allowed: `max-queue` == `max_queue`); flags given on the command line win over YAML.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from contracts.worker import WorkerConfig
from engine.config import KV_DTYPE_BYTES, PRESETS, is_checkpoint_dir
from engine.model_registry import DEFAULT_MODEL, MODELS

MODES = ("disagg", "colocated", "auto")
POLICIES = ("round_robin", "least_loaded", "prefix")
TRANSPORTS = ("nixl", "local")
WEIGHT_DTYPES = ("fp8", "bf16", "fp32")


class ConfigError(ValueError):
    """A bad setting; the message names the flag (and the YAML key it came from, if any)."""


@dataclass
class ServeConfig:
    mode: str = "disagg"  # "disagg": separate prefill/decode pools | "colocated": decode workers prefill too
    model: str = DEFAULT_MODEL  # registry model (pulled on first use), preset, checkpoint directory or .gguf file
    dtype: str = "fp8"  # weights
    kv_dtype: str = "fp8"
    device: str = "cpu"
    prefill: int = 1  # prefill workers (disagg only)
    decode: int = 1  # decode (or colocated) workers
    chunk_size: int | None = None  # prefill chunk in tokens; None = whole prompts
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    ray_address: str | None = None  # None = embedded local Ray
    api_key: str | None = None  # protects every endpoint but /health
    max_queue: int = 256  # requests admitted and not finished; beyond it: 429
    gpus_per_worker: float = 0.0
    num_blocks: int = 1024  # KV blocks per worker
    block_size: int = 16
    prefix_cache: bool = True  # automatic prefix caching in every pool (--no-prefix-cache)
    max_num_seqs: int = 64
    enforce_eager: bool = False  # CUDA: decode steps run eagerly instead of replaying captured graphs
    # CPU: oneDNN GEMMs run at this many row counts per power of two (0 = any): bounds the
    # per-shape kernel caches that grew workers' RSS with every new prompt length (issue 22)
    gemm_row_buckets: int = 4
    # the health loop warns when a worker's RSS has grown this much past its level after
    # `rss_warmup_steps` engine steps (and again at each further multiple); 0 = no watch
    rss_growth_warn_mb: float = 512.0
    rss_warmup_steps: int = 200
    transport: str = "nixl"
    lease_s: float = 30.0  # prefill KV is freed if decode has not pulled it by then
    transfer_timeout_s: float = 30.0  # one KV pull; also capped by the lease time left
    # Checksum every pulled KV block on both sides; off by default: on the CPU VM it costs 63-161%
    # (median 78%) of the transfer time (docs/security.md), far above the 2% bar for on.
    verify_kv: bool = False
    shutdown_timeout_s: float = 30.0  # SIGTERM/SIGINT: how long open requests may take to finish
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    served_model_name: str | None = None  # the name clients send as "model"; None = the model's name
    # Ray custom resources per worker: one mapping for every worker of the pool, or a list with
    # one mapping per worker (e.g. [{"node2": 1}, {"node3": 1}] spreads two decode workers).
    prefill_resources: dict[str, float] | list[dict[str, float]] = field(default_factory=dict)
    decode_resources: dict[str, float] | list[dict[str, float]] = field(default_factory=dict)
    link_gbps: float | None = None  # nominal rate of the link between the pools, for the timeline
    # --mode auto: the SLO pair the per-request dispatch decides under, and the cost-model
    # calibration it predicts with (None: the one `pdserve bench chunks` left for this model)
    slo_ttft_ms: float = 1000.0
    slo_itl_ms: float = 50.0
    calibration: str | None = None
    # OTLP/HTTP collector for request traces (router/tracing.py); None: the OTEL_EXPORTER_OTLP_* variables, if set
    otlp_endpoint: str | None = None

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
        def bad(flag: str, why: str) -> ConfigError:
            value = getattr(self, flag.lstrip("-").replace("-", "_"))
            return ConfigError(f"{flag} {value!r}: {why}")

        _check_types(self)
        if self.mode not in MODES:
            raise bad("--mode", f"must be one of {', '.join(MODES)}")
        if self.model not in PRESETS and self.model not in MODELS and not is_checkpoint_dir(self.model):
            raise bad(
                "--model",
                f"not a preset ({', '.join(PRESETS)}), a registry model ({', '.join(MODELS)}), "
                "a directory containing config.json or a .gguf file",
            )
        if self.dtype not in WEIGHT_DTYPES:
            raise bad("--dtype", f"must be one of {', '.join(WEIGHT_DTYPES)}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise bad("--kv-dtype", f"must be one of {', '.join(sorted(KV_DTYPE_BYTES))}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise bad("--device", "must be cpu, cuda or cuda:N")
        if self.mode in ("disagg", "auto") and self.prefill < 1:
            raise bad("--prefill", f"{self.mode} mode needs at least one prefill worker")
        if self.slo_ttft_ms <= 0 or self.slo_itl_ms <= 0:
            raise bad("--slo-ttft-ms" if self.slo_ttft_ms <= 0 else "--slo-itl-ms", "must be > 0 ms")
        if self.calibration is not None and not Path(self.calibration).is_file():
            raise bad("--calibration", "no such file")
        if self.prefill < 0:
            raise bad("--prefill", "must be >= 0")
        if self.decode < 1:
            raise bad("--decode", "must be >= 1")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise bad("--chunk-size", "must be >= 1 (omit it for whole-prompt prefill)")
        if self.policy not in POLICIES:
            raise bad("--policy", f"must be one of {', '.join(POLICIES)}")
        if not 0 <= self.port <= 65535:
            raise bad("--port", "must be in 0..65535 (0 = any free port)")
        if self.api_key is not None and not self.api_key.strip():
            raise bad("--api-key", "must not be empty")
        for flag in ("--max-queue", "--num-blocks", "--block-size", "--max-num-seqs", "--max-tokens-limit"):
            if getattr(self, flag[2:].replace("-", "_")) < 1:
                raise bad(flag, "must be >= 1")
        if self.rss_growth_warn_mb < 0:
            raise bad("--rss-growth-warn-mb", "must be >= 0 MB (0 = no warning)")
        if self.rss_warmup_steps < 0:
            raise bad("--rss-warmup-steps", "must be >= 0")
        if self.gemm_row_buckets < 0:
            raise bad("--gemm-row-buckets", "must be >= 0 (0 = off)")
        if self.gpus_per_worker < 0:
            raise bad("--gpus-per-worker", "must be >= 0 (0 on CPU)")
        if self.transport not in TRANSPORTS:
            raise bad("--transport", f"must be one of {', '.join(TRANSPORTS)}")
        if self.lease_s <= 0:
            raise bad("--lease-s", "must be > 0 seconds")
        if self.transfer_timeout_s <= 0:
            raise bad("--transfer-timeout-s", "must be > 0 seconds")
        if self.shutdown_timeout_s < 0:
            raise bad("--shutdown-timeout-s", "must be >= 0 seconds")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise bad("--link-gbps", "must be > 0 Gbit/s")
        for name, size in (("prefill_resources", self.prefill), ("decode_resources", self.decode)):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != size:
                raise ConfigError(f"{name}: a list needs one mapping per worker ({size}), got {len(value)}")
            for one in value if isinstance(value, list) else [value]:
                if not isinstance(one, dict):
                    raise ConfigError(f"{name}: expected a mapping (or a list of mappings), got {one!r}")
                for k, v in one.items():
                    if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                        raise ConfigError(
                            f"{name}: expected a mapping of resource name to a positive number, got {k!r}: {v!r}"
                        )

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


_OPTIONAL = {"chunk_size", "ray_address", "api_key", "served_model_name", "link_gbps", "calibration", "otlp_endpoint"}


def _check_types(cfg: ServeConfig) -> None:
    """YAML can carry any type; refuse the wrong ones with the key's name instead of failing later."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if v is None and f.name in _OPTIONAL:
            continue
        default = f.default
        if f.name in ("prefill_resources", "decode_resources"):
            ok, want = isinstance(v, (dict, list)), "a mapping (or a list of mappings, one per worker)"
        elif f.name == "link_gbps":
            ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
            if ok:
                setattr(cfg, f.name, float(v))
        elif isinstance(default, bool):
            ok, want = isinstance(v, bool), "true or false"
        elif f.name in ("chunk_size",) or isinstance(default, int) and not isinstance(default, bool):
            ok, want = isinstance(v, int) and not isinstance(v, bool), "an integer"
        elif isinstance(default, float):
            ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
            if ok:
                setattr(cfg, f.name, float(v))
        else:
            ok, want = isinstance(v, str), "a string"
        if not ok:
            raise ConfigError(f"--{f.name.replace('_', '-')}: expected {want}, got {v!r}")
