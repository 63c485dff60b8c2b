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
from engine.checkpoint.registry import DEFAULT_MODEL, MODELS
from engine.config import BATCH_WAIT_S, KV_DTYPE_BYTES, PRESETS, PROMPT_STEP_TOKENS, is_checkpoint_dir
from router.config_flags import cli_flag
from router.workers.threads import parse_threads

MODES = ("disagg", "colocated", "auto")
POLICIES = ("round_robin", "least_loaded", "prefix")
TRANSPORTS = ("nixl", "local")
KV_TRANSFERS = ("bulk", "layerwise", "auto")
WEIGHT_DTYPES = ("fp8", "bf16", "fp32")


class ConfigError(ValueError):
    """A bad setting; the message names the flag (and the YAML key it came from, if any)."""


@dataclass
class ServeConfig:
    """Each field is a YAML key and a `pdserve serve` flag (router/config_flags.py): its metadata is
    the flag's group and help, so the help is written once, beside the default it describes."""

    mode: str = field(
        default="disagg",
        metadata=cli_flag(
            "pools",
            "disagg: separate prefill and decode pools; colocated: decode workers also prefill; auto: both "
            "pools, and per request the router prefills locally (chunked, on the decode worker) or remotely, "
            "whichever the calibrated cost model predicts is cheaper under the SLO pair",
            choices=MODES,
        ),
    )
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=cli_flag(
            "pools",
            f"a registry model ({', '.join(MODELS)}; pulled on first use), a preset ({', '.join(PRESETS)}; "
            "random weights), a Hugging Face Llama checkpoint directory or a .gguf file",
        ),
    )
    dtype: str = field(default="fp8", metadata=cli_flag("pools", "weight dtype", choices=WEIGHT_DTYPES))
    kv_dtype: str = field(default="fp8", metadata=cli_flag("pools", "KV cache dtype", choices=("fp8", "bf16", "fp32")))
    device: str = field(default="cpu", metadata=cli_flag("pools", "cpu, cuda or cuda:N"))
    prefill: int = field(default=1, metadata=cli_flag("pools", "prefill workers, disagg mode", metavar="N"))
    decode: int = field(
        default=1, metadata=cli_flag("pools", "decode workers (colocated workers in colocated mode)", metavar="M")
    )
    chunk_size: int | None = field(
        default=None,
        metadata=cli_flag(
            "pools",
            "prefill in chunks of this many tokens mixed into decode steps (default: whole prompts)",
            metavar="TOKENS",
        ),
    )
    policy: str = field(default="round_robin", metadata=cli_flag("pools", "dispatch policy", choices=POLICIES))
    host: str = field(default="127.0.0.1", metadata=cli_flag("router", "address to listen on"))
    port: int = field(default=8000, metadata=cli_flag("router", "port, 0 = any free port"))
    ray_address: str | None = field(
        default=None,
        metadata=cli_flag(
            "pools",
            "an existing Ray cluster (e.g. auto or ray://host:10001); default: start a local one; "
            "'none' runs the workers in this process without Ray",
        ),
    )
    api_key: str | None = field(
        default=None, metadata=cli_flag("router", "require 'Authorization: Bearer KEY' on every endpoint but /health")
    )
    # "In flight": admitted and not finished, streaming or still queued for a worker.
    max_queue: int = field(default=256, metadata=cli_flag("router", "requests in flight before new ones get 429"))
    gpus_per_worker: float = field(
        default=0.0, metadata=cli_flag("pools", "GPUs per Ray actor; 0 on CPU, 0.5 shares a GPU between two")
    )
    num_blocks: int = field(default=1024, metadata=cli_flag("pools", "KV blocks per worker"))
    block_size: int = field(default=16, metadata=cli_flag("pools", "tokens per KV block"))
    prefix_cache: bool = field(
        default=True,
        metadata=cli_flag(
            "pools",
            "do not keep and reuse full KV blocks of equal prefixes (automatic prefix caching is on by default)",
        ),
    )
    max_num_seqs: int = field(default=64, metadata=cli_flag("pools", "sequences per decode batch"))
    enforce_eager: bool = field(
        default=False,
        metadata=cli_flag(
            "pools", "on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs (default: graphs)"
        ),
    )
    # Bounds oneDNN's per-shape kernel caches, which otherwise grow a worker's RSS with every new
    # prompt length.
    cpu_gemm: str = field(
        default="fp32",
        metadata=cli_flag(
            "pools",
            "CPU: the dtype the projections' GEMMs multiply in. fp32 (the default) or bf16; auto: bf16 for "
            "fp8/bf16 weights where the CPU has native bf16 dot products (AVX512-BF16 or AMX), else fp32. "
            "bf16 prefills ~1.5x faster, but a repeated greedy prompt can then answer differently when the "
            "prefix cache or chunking changes how it is computed (engine/model/linear.py)",
            choices=("auto", "fp32", "bf16"),
        ),
    )
    compile: str = field(
        default="auto",
        metadata=cli_flag(
            "pools",
            "CPU: compile the decode step with torch.compile (inductor) at worker start, before it reports "
            "ready: auto (the default: default where it applies, a real checkpoint on CPU with --dtype fp8, "
            "--kv-dtype fp8 and --cpu-gemm fp32, else off; eager if compiling fails), off, default or "
            "max-autotune. Measured 3-6%% faster decode steps for 10-45 s more start-up "
            "(engine/runner/compiled_decode.py)",
            choices=("auto", "off", "default", "max-autotune"),
        ),
    )
    gemm_row_buckets: int = field(
        default=4,
        metadata=cli_flag(
            "pools",
            "CPU: run each oneDNN GEMM at one of N row counts per power of two (tiles of 256 rows above), "
            "padding with zero rows; outputs are bit-identical and the per-shape kernel caches stay bounded "
            "(~27 shapes per weight). 0 = any row count: RSS then grows with every new prompt length",
            metavar="N",
        ),
    )
    # Ray reserves the same CPUs for each worker (its actor's num_cpus and its bundle), and the
    # embedded cluster is started large enough for them (router/workers/threads.py has the rule).
    threads_per_worker: int | None = field(
        default=None,
        metadata=cli_flag(
            "pools",
            "intra-op torch threads of each worker, and the CPUs Ray reserves for it; auto (the default): "
            "the host's cores less one left to the router, shared evenly by the workers on it, at least one "
            "each (a colocated worker on 8 cores: 7; 1P1D on 8 cores: 3 each; anything on 2 cores: 1), or "
            "OMP_NUM_THREADS when the environment sets it",
            metavar="N|auto",
            as_text=True,
        ),
    )
    prompt_threads: int | None = field(
        default=None,
        metadata=cli_flag(
            "pools",
            "intra-op torch threads of a worker's steps that carry --prompt-threads-min-tokens or more prompt "
            "tokens; auto (the "
            "default): colocated without --chunk-size on this host, the workers' threads plus the core left "
            "to the router (no token streams while a whole prompt runs: 2 on a 2-core machine); otherwise "
            "as --threads-per-worker",
            metavar="N|auto",
            as_text=True,
        ),
    )
    prompt_threads_min_tokens: int | None = field(
        default=None,
        metadata=cli_flag(
            "pools",
            f"the fewest prompt tokens a step carries to run on --prompt-threads (default {PROMPT_STEP_TOKENS}); "
            "`pdserve plan` prices the default",
            metavar="N",
        ),
    )
    rss_growth_warn_mb: float = field(
        default=512.0,
        metadata=cli_flag(
            "pools",
            "log a warning when a worker's resident memory grows this much past its level after warm-up "
            "(and at each further multiple); 0 = off",
            metavar="MB",
        ),
    )
    rss_warmup_steps: int = field(
        default=200,
        metadata=cli_flag("pools", "engine steps a worker runs before its RSS baseline is taken", metavar="N"),
    )
    transport: str = field(default="nixl", metadata=cli_flag("pools", "KV transport between pools", choices=TRANSPORTS))
    lease_s: float = field(
        default=30.0, metadata=cli_flag("pools", "seconds prefill keeps KV that decode has not pulled")
    )
    batch_wait_ms: float = field(
        default=BATCH_WAIT_S * 1e3,
        metadata=cli_flag(
            "pools",
            "how long an idle worker gathers requests after the first arrives before its step, so that "
            "requests sent together are prefilled together (never under load); 0 = start at once",
        ),
    )
    # auto by default: on the cluster rehearsal it was never slower than bulk and hid 20-90x more of
    # the transfer on long prompts (docs/results.md, layer-wise section); streaming every prompt
    # pays the stream-opening call where a fast link leaves nothing to hide
    kv_transfer: str = field(
        default="auto",
        metadata=cli_flag(
            "pools",
            "how the KV crosses from prefill to decode: bulk pulls it whole once the prefill has ended; "
            "layerwise streams each group of layers while the prompt is still prefilling (only the last "
            "group's share stays between the first and second token); auto (the default) streams the "
            "prompts long enough to gain, by the cost model, at --link-gbps or the pull rate measured so far "
            "(bulk until a pull and a prefill were measured)",
            choices=("bulk", "layerwise", "auto"),
        ),
    )
    kv_stream_layers: int = field(
        default=1,
        metadata=cli_flag(
            "pools",
            "layers announced and pulled together under --kv-transfer layerwise/auto: fewer leave less "
            "exposed after the prefill, more cost fewer messages and pulls",
            metavar="N",
        ),
    )
    # A pull is also capped by the lease time left: the prefill side frees the blocks then.
    transfer_timeout_s: float = field(
        default=30.0, metadata=cli_flag("pools", "seconds one KV pull may take before the request fails")
    )
    # Off by default: on the CPU VM it costs 63-161% (median 78%) of the transfer time
    # (docs/security.md), far above the 2% bar for on.
    verify_kv: bool = field(
        default=False,
        metadata=cli_flag(
            "pools",
            "checksum every KV block on both sides of a pull; a mismatch fails that request with a clear "
            "error instead of decoding corrupt KV (default off: on CPU it costs about as much as the transfer "
            "itself)",
            negatable=True,
        ),
    )
    shutdown_timeout_s: float = field(
        default=30.0,
        metadata=cli_flag(
            "router",
            "on SIGTERM or SIGINT: refuse new requests (503), give open ones this long to finish, end the rest "
            "with an error event, stop the pools and exit 0",
        ),
    )
    max_tokens_limit: int = field(default=4096, metadata=cli_flag("router", "largest max_tokens a request may ask for"))
    served_model_name: str | None = field(
        default=None, metadata=cli_flag("router", "the model name clients send (default: the model's)")
    )
    # One mapping for every worker of the pool, or a list with one mapping per worker (e.g.
    # [{"node2": 1}, {"node3": 1}] spreads two decode workers).
    prefill_resources: dict[str, float] | list[dict[str, float]] = field(
        default_factory=dict,
        metadata=cli_flag(
            "pools",
            "Ray custom resources of each prefill worker, e.g. '{\"node1\": 1}' (every worker) or "
            '\'[{"node1": 1}, {"node2": 1}]\' (one per worker); pins the pool to labelled nodes',
            metavar="JSON",
        ),
    )
    decode_resources: dict[str, float] | list[dict[str, float]] = field(
        default_factory=dict,
        metadata=cli_flag("pools", "the same for each decode (or colocated) worker", metavar="JSON"),
    )
    link_gbps: float | None = field(
        default=None,
        metadata=cli_flag(
            "pools",
            "nominal rate of the link between the pools in Gbit/s; each request's timeline then "
            "shows the measured KV pull rate beside it (e.g. the rate of `pdserve cluster up`)",
            metavar="G",
        ),
    )
    slo_ttft_ms: float = field(default=1000.0, metadata=cli_flag("auto", "time-to-first-token SLO auto decides under"))
    slo_itl_ms: float = field(
        default=50.0,
        metadata=cli_flag(
            "auto",
            "inter-token SLO of the streams in flight; a local prefill may not stretch a step past it",
        ),
    )
    calibration: str | None = field(
        default=None,
        metadata=cli_flag(
            "auto",
            "cost-model calibration with a step_fit (`pdserve bench chunks` writes one); default: "
            "benchmarks/results/chunks-<model>-<device>.calibration.json",
            metavar="FILE",
        ),
    )
    otlp_endpoint: str | None = field(
        default=None,
        metadata=cli_flag(
            "observability",
            "export one OpenTelemetry trace per request over OTLP/HTTP to this collector, e.g. "
            "http://127.0.0.1:4318 (/v1/traces is added to a URL without a path); the standard "
            "OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT variables do the same (default: off)",
            metavar="URL",
        ),
    )

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
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise bad("--threads-per-worker", "must be >= 1 (or auto)")
        if self.prompt_threads is not None and self.prompt_threads < 1:
            raise bad("--prompt-threads", "must be >= 1 (or auto)")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise bad("--batch-wait-ms", "must be between 0 and 1000 ms")
        if self.prompt_threads_min_tokens is not None and self.prompt_threads_min_tokens < 1:
            raise bad("--prompt-threads-min-tokens", "must be >= 1")
        if self.gemm_row_buckets < 0:
            raise bad("--gemm-row-buckets", "must be >= 0 (0 = off)")
        if self.compile not in ("off", "auto") and (
            self.device != "cpu" or self.dtype != "fp8" or self.kv_dtype != "fp8" or self.cpu_gemm != "fp32"
        ):
            raise bad("--compile", "compiles the CPU decode step of --dtype fp8, --kv-dtype fp8, --cpu-gemm fp32")
        if self.gpus_per_worker < 0:
            raise bad("--gpus-per-worker", "must be >= 0 (0 on CPU)")
        if self.transport not in TRANSPORTS:
            raise bad("--transport", f"must be one of {', '.join(TRANSPORTS)}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise bad("--kv-transfer", f"must be one of {', '.join(KV_TRANSFERS)}")
        if self.kv_stream_layers < 1:
            raise bad("--kv-stream-layers", "must be >= 1")
        if self.kv_transfer == "layerwise" and self.mode == "colocated":  # auto: nothing to stream there
            raise bad("--kv-transfer", "streams KV between pools: it needs --mode disagg or auto")
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
            cpu_gemm=self.cpu_gemm,
            compile=self.compile,
            torch_threads=self.threads_per_worker,  # None (auto) until router/launch.py resolves it
            prompt_threads=self.prompt_threads,  # likewise
            prompt_threads_min_tokens=self.prompt_threads_min_tokens,
            batch_wait_s=self.batch_wait_ms / 1e3,
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


def _check_types(cfg: ServeConfig) -> None:
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
