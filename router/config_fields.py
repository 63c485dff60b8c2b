"""`ServeSettings`: every setting of `pdserve serve`, its default, and the flag that sets it.

Each field is a YAML key and a `pdserve serve` flag at once (router/config_flags.py builds the flags
from the fields' metadata), so a setting's help is written once, beside the default it describes.
Checking the values is router/config_checks.py's job; building them from flags and YAML, and what
the rest of the server reads off them, router/config.py's (`ServeConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.checkpoint.registry import DEFAULT_MODEL, MODELS
from engine.config import BATCH_WAIT_MAX_S, BATCH_WAIT_S, PRESETS, PROMPT_STEP_TOKENS
from router.config_flags import cli_flag

MODES = ("disagg", "colocated", "auto")
POLICIES = ("round_robin", "least_loaded", "prefix")
TRANSPORTS = ("nixl", "local")
KV_TRANSFERS = ("bulk", "layerwise", "auto")
WEIGHT_DTYPES = ("fp8", "bf16", "fp32")


@dataclass
class ServeSettings:
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
            "an idle worker woken by a request gathers more until none has come for this long before its "
            "step, so that requests sent together are prefilled together (never under load); 0 = start at once",
        ),
    )
    batch_wait_max_ms: float = field(
        default=BATCH_WAIT_MAX_S * 1e3,
        metadata=cli_flag(
            "pools", "the longest an idle worker gathers, from the first request (--batch-wait-ms restarts per request)"
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
