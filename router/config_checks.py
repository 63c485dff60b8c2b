"""The serve settings checked: each bad value refused with the flag (or YAML key) that set it.

`ServeConfig.validate` (router/config.py) runs `check_settings` once the flags and the YAML file
are merged, so a bad setting stops `pdserve serve` before any worker starts, and the message names
what to fix. YAML can carry any type, so the types are checked (and numbers normalized) first.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from engine.checkpoint.registry import MODELS
from engine.config import KV_DTYPE_BYTES, PRESETS, is_checkpoint_dir
from router.config_fields import KV_TRANSFERS, MODES, POLICIES, TRANSPORTS, WEIGHT_DTYPES, ServeSettings
from router.workers.threads import parse_threads


class ConfigError(ValueError):
    """A bad setting; the message names the flag (and the YAML key it came from, if any)."""


def check_settings(cfg: ServeSettings) -> None:
    """Raise ConfigError for the first bad setting, naming its flag; normalizes types on the way
    (a YAML integer where a float goes becomes that float; threads given as text become numbers)."""

    def bad(flag: str, why: str) -> ConfigError:
        value = getattr(cfg, flag.lstrip("-").replace("-", "_"))
        return ConfigError(f"{flag} {value!r}: {why}")

    _check_types(cfg)
    if cfg.mode not in MODES:
        raise bad("--mode", f"must be one of {', '.join(MODES)}")
    if cfg.model not in PRESETS and cfg.model not in MODELS and not is_checkpoint_dir(cfg.model):
        raise bad(
            "--model",
            f"not a preset ({', '.join(PRESETS)}), a registry model ({', '.join(MODELS)}), "
            "a directory containing config.json or a .gguf file",
        )
    if cfg.dtype not in WEIGHT_DTYPES:
        raise bad("--dtype", f"must be one of {', '.join(WEIGHT_DTYPES)}")
    if cfg.kv_dtype not in KV_DTYPE_BYTES:
        raise bad("--kv-dtype", f"must be one of {', '.join(sorted(KV_DTYPE_BYTES))}")
    if not (cfg.device == "cpu" or cfg.device == "cuda" or cfg.device.startswith("cuda:")):
        raise bad("--device", "must be cpu, cuda or cuda:N")
    if cfg.mode in ("disagg", "auto") and cfg.prefill < 1:
        raise bad("--prefill", f"{cfg.mode} mode needs at least one prefill worker")
    if cfg.slo_ttft_ms <= 0 or cfg.slo_itl_ms <= 0:
        raise bad("--slo-ttft-ms" if cfg.slo_ttft_ms <= 0 else "--slo-itl-ms", "must be > 0 ms")
    if cfg.calibration is not None and not Path(cfg.calibration).is_file():
        raise bad("--calibration", "no such file")
    if cfg.prefill < 0:
        raise bad("--prefill", "must be >= 0")
    if cfg.decode < 1:
        raise bad("--decode", "must be >= 1")
    if cfg.chunk_size is not None and cfg.chunk_size < 1:
        raise bad("--chunk-size", "must be >= 1 (omit it for whole-prompt prefill)")
    if cfg.policy not in POLICIES:
        raise bad("--policy", f"must be one of {', '.join(POLICIES)}")
    if not 0 <= cfg.port <= 65535:
        raise bad("--port", "must be in 0..65535 (0 = any free port)")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise bad("--api-key", "must not be empty")
    for flag in ("--max-queue", "--num-blocks", "--block-size", "--max-num-seqs", "--max-tokens-limit"):
        if getattr(cfg, flag[2:].replace("-", "_")) < 1:
            raise bad(flag, "must be >= 1")
    if cfg.rss_growth_warn_mb < 0:
        raise bad("--rss-growth-warn-mb", "must be >= 0 MB (0 = no warning)")
    if cfg.rss_warmup_steps < 0:
        raise bad("--rss-warmup-steps", "must be >= 0")
    if cfg.threads_per_worker is not None and cfg.threads_per_worker < 1:
        raise bad("--threads-per-worker", "must be >= 1 (or auto)")
    if cfg.prompt_threads is not None and cfg.prompt_threads < 1:
        raise bad("--prompt-threads", "must be >= 1 (or auto)")
    if not 0 <= cfg.batch_wait_ms <= 1000:
        raise bad("--batch-wait-ms", "must be between 0 and 1000 ms")
    if not 0 <= cfg.batch_wait_max_ms <= 1000:
        raise bad("--batch-wait-max-ms", "must be between 0 and 1000 ms")
    if cfg.prompt_threads_min_tokens is not None and cfg.prompt_threads_min_tokens < 1:
        raise bad("--prompt-threads-min-tokens", "must be >= 1")
    if cfg.gemm_row_buckets < 0:
        raise bad("--gemm-row-buckets", "must be >= 0 (0 = off)")
    if cfg.compile not in ("off", "auto") and (
        cfg.device != "cpu" or cfg.dtype != "fp8" or cfg.kv_dtype != "fp8" or cfg.cpu_gemm != "fp32"
    ):
        raise bad("--compile", "compiles the CPU decode step of --dtype fp8, --kv-dtype fp8, --cpu-gemm fp32")
    if cfg.gpus_per_worker < 0:
        raise bad("--gpus-per-worker", "must be >= 0 (0 on CPU)")
    if cfg.transport not in TRANSPORTS:
        raise bad("--transport", f"must be one of {', '.join(TRANSPORTS)}")
    if cfg.kv_transfer not in KV_TRANSFERS:
        raise bad("--kv-transfer", f"must be one of {', '.join(KV_TRANSFERS)}")
    if cfg.kv_stream_layers < 1:
        raise bad("--kv-stream-layers", "must be >= 1")
    if cfg.kv_transfer == "layerwise" and cfg.mode == "colocated":  # auto: nothing to stream there
        raise bad("--kv-transfer", "streams KV between pools: it needs --mode disagg or auto")
    if cfg.lease_s <= 0:
        raise bad("--lease-s", "must be > 0 seconds")
    if cfg.transfer_timeout_s <= 0:
        raise bad("--transfer-timeout-s", "must be > 0 seconds")
    if cfg.shutdown_timeout_s < 0:
        raise bad("--shutdown-timeout-s", "must be >= 0 seconds")
    if cfg.link_gbps is not None and cfg.link_gbps <= 0:
        raise bad("--link-gbps", "must be > 0 Gbit/s")
    for name, size in (("prefill_resources", cfg.prefill), ("decode_resources", cfg.decode)):
        value = getattr(cfg, name)
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


_OPTIONAL = {
    "chunk_size",
    "ray_address",
    "api_key",
    "served_model_name",
    "link_gbps",
    "calibration",
    "otlp_endpoint",
    "threads_per_worker",
    "prompt_threads",
    "prompt_threads_min_tokens",
}


_OPTIONAL_INTS = ("chunk_size", "prompt_threads_min_tokens")  # None or a whole number


def _check_types(cfg: ServeSettings) -> None:
    """YAML can carry any type; refuse the wrong ones with the key's name instead of failing later."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if v is None and f.name in _OPTIONAL:
            continue
        default = f.default
        if f.name in ("prefill_resources", "decode_resources"):
            ok, want = isinstance(v, (dict, list)), "a mapping (or a list of mappings, one per worker)"
        elif f.name in ("threads_per_worker", "prompt_threads"):  # a number or the word auto (CLI text, YAML either)
            try:
                setattr(cfg, f.name, parse_threads(v))
                ok, want = True, ""
            except ValueError:
                ok, want = False, "a whole number of threads or auto"
        elif f.name == "link_gbps":
            ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
            if ok:
                setattr(cfg, f.name, float(v))
        elif isinstance(default, bool):
            ok, want = isinstance(v, bool), "true or false"
        elif f.name in _OPTIONAL_INTS or isinstance(default, int) and not isinstance(default, bool):
            ok, want = isinstance(v, int) and not isinstance(v, bool), "an integer"
        elif isinstance(default, float):
            ok, want = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
            if ok:
                setattr(cfg, f.name, float(v))
        else:
            ok, want = isinstance(v, str), "a string"
        if not ok:
            raise ConfigError(f"--{f.name.replace('_', '-')}: expected {want}, got {v!r}")
