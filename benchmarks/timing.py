"""Timing helpers shared by the engine benchmarks (`bench chunks`, `bench article`).

- `time_call`: one call, timed the way a caller sees it. On CUDA with events recorded around
  the call and a synchronize after it; on CPU with perf_counter. The engine's forward ends with
  a host copy of the logits, so both include the host-side step preparation a real step pays.
- `measure`: warm-up, then repeats, summarised by the median (robust to a noisy neighbour).
- `copy_bandwidth`: a large tensor copy's (read + write) bytes per second (`bench step`'s floor).
- `probe_device`: the device's achievable memory bandwidth (a large tensor copy) and dense
  GEMM FLOP/s, measured in the same run. On a CPU there is no datasheet, so these two numbers
  are the "device spec" the cost model is evaluated against.
- `Harness` (and CLI helpers): one ModelRunner, KV pool and block manager, a decode batch with
  pre-filled KV, and the device spec the cost model predicts with.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from costmodel.provenance import OUT_DIR_HELP
from engine.torch_compat import scaled_mm


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of `fn` takes on `device`."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    repeats: int

    @classmethod
    def of(cls, samples: list[float]) -> Timing:
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))


def measure(fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 1) -> Timing:
    for _ in range(warmup):
        fn()
    sync(device)
    return Timing.of([time_call(fn, device) for _ in range(max(1, repeats))])


@dataclass(frozen=True)
class DeviceProbe:
    """What this run measured about the device itself."""

    device: str
    copy_gbps: float  # (bytes read + bytes written) / s of a large tensor copy, GB/s (1e9)
    copy_bytes: int  # size of the copied tensor
    gemm_tflops: float  # dense GEMM, TFLOP/s (1e12)
    gemm_dtype: str  # dtype of that GEMM ("fp32" on CPU, "bf16"/"fp8" on CUDA)
    gemm_shape: int  # n of the n x n x n GEMM

    def describe(self) -> str:
        return (
            f"measured in this run on {self.device}: {self.copy_gbps:.1f} GB/s tensor copy "
            f"({self.copy_bytes / 2**20:.0f} MiB, read+write), {self.gemm_tflops * 1e3:.1f} GFLOP/s "
            f"{self.gemm_dtype} GEMM (n={self.gemm_shape})"
        )


def _gemm_fn(n: int, dtype: str, device: torch.device) -> Callable[[], Any]:
    if dtype == "fp8":
        fp8 = torch.float8_e4m3fn
        a = torch.randn(n, n, device=device).to(fp8)
        b = torch.randn(n, n, device=device).to(fp8).t()  # _scaled_mm wants column-major B
        one = torch.ones((), device=device)
        return lambda: scaled_mm(a, b, one, one, torch.bfloat16)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    return lambda: a @ b


def copy_bandwidth(device: torch.device, mib: int | None = None, repeats: int = 5) -> tuple[float, int]:
    """(bytes read + bytes written) per second of a large tensor copy, and the bytes copied: the
    memory traffic rate a memory-bound step can hope for. 256 MiB on a CPU (8x a server L3),
    4 GiB on a GPU."""
    mib = mib or (4096 if device.type == "cuda" else 256)
    n_elem = mib * 2**20 // 4
    src = torch.rand(n_elem, device=device)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), device, repeats, warmup=2).median_s  # noqa: F821 - ruff misreads the later `del`
    del src, dst
    return 2 * n_elem * 4 / t, n_elem * 4


def probe_device(
    device: torch.device,
    gemm_dtype: str | None = None,
    copy_mib: int | None = None,
    gemm_n: int | None = None,
    repeats: int = 5,
) -> DeviceProbe:
    """Measure copy bandwidth and GEMM FLOP/s. Sizes default to what saturates the device
    without taking long: 256 MiB / n=2048 on a CPU, 4 GiB / n=8192 on a GPU."""
    cuda = device.type == "cuda"
    gemm_n = gemm_n or (8192 if cuda else 2048)
    gemm_dtype = gemm_dtype or ("bf16" if cuda else "fp32")
    copy_bps, copy_bytes = copy_bandwidth(device, copy_mib, repeats)
    try:
        fn = _gemm_fn(gemm_n, gemm_dtype, device)
        t_gemm = measure(fn, device, repeats, warmup=2).median_s
    except (RuntimeError, TypeError):  # e.g. no FP8 GEMM on this GPU: fall back to bf16
        gemm_dtype = "bf16"
        t_gemm = measure(_gemm_fn(gemm_n, "bf16", device), device, repeats, warmup=2).median_s
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return DeviceProbe(
        device=name,
        copy_gbps=copy_bps / 1e9,
        copy_bytes=copy_bytes,
        gemm_tflops=2 * gemm_n**3 / t_gemm / 1e12,
        gemm_dtype=gemm_dtype,
        gemm_shape=gemm_n,
    )


# --- Engine harness shared by `bench chunks` and `bench article` ------------------------------
# (Kept here because the benchmark files of this issue were fixed in advance; it would read
# better as its own module, benchmarks/engine_bench.py.)


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from cli import CliError  # noqa: PLC0415

        raise CliError("--device cuda: no CUDA device is available")
    return torch.device(name)


def parse_ints(text: str, flag: str) -> list[int]:
    from cli import CliError  # noqa: PLC0415

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CliError(f"{flag} needs at least one value, all >= 1 (got {text!r})")
    return sorted(set(vals))


def table(headers: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * x for x in w]), *(fmt(r) for r in rows)])


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    from engine.config import PRESETS  # noqa: PLC0415

    g = p.add_argument_group("model and device")
    g.add_argument(
        "--model",
        default=None,
        help=f"preset ({', '.join(PRESETS)}) or checkpoint directory "
        "(default: tiny on CPU; llama-3.1-70b on CUDA if it fits, else llama-3.1-8b)",
    )
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    g.add_argument("--dtype", choices=["fp8", "bf16", "fp32"], default="fp8", help="weight dtype (default fp8)")
    g.add_argument(
        "--kv-dtype",
        choices=["fp8", "bf16", "fp32"],
        default=None,
        help="KV cache dtype (default fp8, fp32 with --dtype fp32)",
    )
    g.add_argument(
        "--kv-fill",
        choices=["prefill", "random"],
        default=None,
        help="how the decode batch's KV is filled: a prefill of random tokens (CPU default) or "
        "random values written into the pool (CUDA default, fast at long contexts)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default on CPU: 1, because on a shared machine an oversubscribed "
        "thread pool turns into 10-50x outliers; the device probe runs with the same threads, "
        "so predictions stay comparable. Raise it on a quiet machine)",
    )
    c = p.add_argument_group("cost model")
    c.add_argument("--mfu", type=float, default=0.4, help="MFU of the predictions (default 0.4, the article's)")
    c.add_argument(
        "--hardware",
        default=None,
        help="datasheet preset for the predictions (default: the "
        "GPU's datasheet if known, else this run's measured copy bandwidth and GEMM rate)",
    )
    c.add_argument("--peak-tflops", type=float, default=None, help="override the peak used for predictions and MFU")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="result name under --out-dir (default: <bench>-<model>-<device>)")
    o.add_argument(
        "--out-dir",
        default=None,
        help=OUT_DIR_HELP,
    )
    o.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def config_record(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}


# Known GPUs -> datasheet preset of the cost model (substring of torch.cuda.get_device_name).
_GPU_DATASHEETS = (("H200", "h200"), ("H100", "h100-sxm"), ("B200", "b200"), ("A100", "a100-80g"))
_CUDA_MARGIN = 8e9  # activations, allocator slack, CUDA context


def cuda_kv_budget(cfg: Any, weight_dtype: str, device: torch.device) -> float:
    """Bytes left for the KV pool on `device` once `cfg`'s weights are loaded (rough, safe side)."""
    from costmodel import cost_model as cm  # noqa: PLC0415

    free = torch.cuda.mem_get_info(device)[0]
    m = cm.ModelSpec.from_config(cfg)
    # embedding and lm_head stay bf16 (engine/model.py); the rest is in the weight dtype
    head = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    weights = cm.weight_bytes(m, weight_dtype) + head * 2
    return free - weights - _CUDA_MARGIN


def kv_pool_bytes(cfg: Any, kv_dtype: str, tokens: int, block_size: int = 16) -> int:
    from engine.config import CacheConfig  # noqa: PLC0415
    from engine.kv_layout import KVLayout  # noqa: PLC0415

    return KVLayout.build(cfg, CacheConfig(block_size, 1, kv_dtype)).block_bytes * -(-tokens // block_size)


def default_model(args: argparse.Namespace, device: torch.device, kv_tokens: int) -> str:
    """tiny on CPU; on CUDA the article's llama-3.1-70b if its weights plus `kv_tokens` of KV fit
    in free memory, else llama-3.1-8b."""
    if args.model is not None:
        return args.model
    if device.type != "cuda":
        return "tiny"
    from engine.config import PRESETS  # noqa: PLC0415

    kv_dtype = args.kv_dtype or ("fp32" if args.dtype == "fp32" else "fp8")
    big = PRESETS["llama-3.1-70b"]
    fits = cuda_kv_budget(big, args.dtype, device) >= kv_pool_bytes(big, kv_dtype, kv_tokens)
    return big.name if fits else "llama-3.1-8b"


@dataclass
class Harness:
    """One ModelRunner with a KV pool and block manager, plus the device spec for predictions."""

    device: torch.device
    device_name: str
    cfg: Any  # ModelConfig
    runner: Any  # ModelRunner
    bm: Any  # BlockManager
    compute_dtype: str  # what the FLOPs run in and the weights are read as (fp32 on CPU)
    kv_dtype: str
    probe: DeviceProbe
    spec: Any  # cost_model.HardwareSpec
    spec_is_measured: bool
    peak_flops: float

    @classmethod
    def build(
        cls,
        args: argparse.Namespace,
        device: torch.device,
        kv_tokens: int,
        max_pos: int,
        pool_blocks: int = 1,
        model: str | None = None,
    ) -> Harness:
        from cli import CliError  # noqa: PLC0415
        from costmodel import cost_model as cm  # noqa: PLC0415
        from engine.block_manager import BlockManager  # noqa: PLC0415
        from engine.config import (  # noqa: PLC0415
            PRESETS,
            CacheConfig,
            is_checkpoint_dir,  # noqa: PLC0415
            resolve_model_config,
        )
        from engine.model_runner import ModelRunner  # noqa: PLC0415

        model = model or args.model
        if device.type == "cpu" and getattr(args, "threads", None) is None:
            args.threads = 1
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise CliError("--threads must be >= 1")
            torch.set_num_threads(args.threads)
        from engine.model_registry import PullError  # noqa: PLC0415
        from engine.model_registry import resolve as registry_resolve  # noqa: PLC0415

        try:
            model = registry_resolve(model)  # a registry name -> its cache directory (pulled on first use)
        except PullError as e:
            raise CliError(str(e)) from None
        if model not in PRESETS and not is_checkpoint_dir(model):
            raise CliError(
                f"--model {model!r}: not a preset ({', '.join(PRESETS)}), a registry model, a checkpoint "
                "directory or a .gguf file"
            )
        cfg = resolve_model_config(model)
        if max_pos > cfg.max_position_embeddings:
            raise CliError(f"{max_pos} tokens exceed {cfg.name}'s context of {cfg.max_position_embeddings}")
        kv_dtype = args.kv_dtype or ("fp32" if args.dtype == "fp32" else "fp8")
        cache = CacheConfig(block_size=16, num_blocks=-(-kv_tokens // 16) + pool_blocks, kv_dtype=kv_dtype)
        if device.type == "cuda":
            from engine.kv_layout import KVLayout  # noqa: PLC0415

            need = KVLayout.build(cfg, cache).pool_bytes
            budget = cuda_kv_budget(cfg, args.dtype, device)
            if need > budget:
                raise CliError(
                    f"{cfg.name}: the KV pool needs {need / 1e9:.1f} GB but ~{budget / 1e9:.1f} GB are "
                    f"left after the weights; use a smaller batch/context or model"
                )
        probe_dtype = "fp32" if device.type == "cpu" else ("bf16" if args.dtype == "fp32" else args.dtype)
        compute = "fp32" if device.type == "cpu" else args.dtype
        probe = probe_device(device, gemm_dtype=probe_dtype)
        name = probe.device if device.type == "cuda" else f"cpu: {_cpu_name()}"
        hw_name = args.hardware
        if hw_name is None and device.type == "cuda":
            hw_name = next((k for s, k in _GPU_DATASHEETS if s in name), None)
        if hw_name:
            try:
                spec = cm.resolve_hardware(hw_name)
            except ValueError as e:
                raise CliError(str(e)) from None
        else:
            spec = cm.HardwareSpec(
                f"{name} (measured)",
                probe.copy_gbps * 1e9,
                {probe.gemm_dtype: probe.gemm_tflops * 1e12},
                _mem_bytes(device),
                probe.describe(),
            )
        if args.peak_tflops is not None:
            if args.peak_tflops <= 0:
                raise CliError("--peak-tflops must be positive")
            spec = replace(spec, peak_flops={**spec.peak_flops, compute: args.peak_tflops * 1e12})
        if compute not in spec.peak_flops:
            raise CliError(f"{spec.name} has no {compute} peak; give --peak-tflops")
        runner = ModelRunner(cfg, cache, args.dtype, device, None if model in PRESETS else model, seed=args.seed)
        bm = BlockManager(cache.num_blocks, cache.block_size)
        return cls(device, name, cfg, runner, bm, compute, kv_dtype, probe, spec, not hw_name, spec.peak(compute))

    def spec_record(self) -> dict[str, Any]:
        s = self.spec
        return {
            "spec": {
                "name": s.name,
                "mem_bw_gbps": s.mem_bw / 1e9,
                "peak_tflops": {k: v / 1e12 for k, v in s.peak_flops.items()},
                "source": s.source,
                "source_kind": "measured" if self.spec_is_measured else "datasheet",
            },
            "probe": asdict(self.probe),
            "torch_threads": torch.get_num_threads(),
        }

    def decode_batch(self, batch: int, ctx: int, fill: str | None, seed: int = 0) -> list[Any]:
        """`batch` sequences with `ctx` tokens of KV each, as decode StepItems (one new token at
        position ctx; every step rewrites that slot, so the context stays `ctx`)."""
        from engine.model_runner import StepItem  # noqa: PLC0415

        fill = fill or ("random" if self.device.type == "cuda" else "prefill")
        tables = [self.bm.allocate(self.bm.blocks_for(ctx + 1)) for _ in range(batch)]
        gen = torch.Generator().manual_seed(seed)
        if fill == "random":
            fill_kv_random(self.runner.cache, [b for t in tables for b in t], seed)
        else:  # a real prefill of random tokens, a few sequences per forward
            per = max(1, 4096 // ctx)
            for i in range(0, batch, per):
                self.runner.forward(
                    [
                        StepItem(
                            torch.randint(0, self.cfg.vocab_size, (ctx,), generator=gen).tolist(),
                            0,
                            t,
                            want_logits=False,
                        )
                        for t in tables[i : i + per]
                    ]
                )
        toks = torch.randint(0, self.cfg.vocab_size, (batch,), generator=gen).tolist()
        return [StepItem([tok], ctx, t) for tok, t in zip(toks, tables)]


@torch.inference_mode()
def fill_kv_random(cache: Any, blocks: list[int], seed: int = 0) -> None:
    """Small random K/V in `blocks` (exactly representable in fp8 range) and unit fp8 scales.
    Random raw bytes would not do: many fp8 bit patterns are NaN."""
    gen = torch.Generator(device=cache.device).manual_seed(seed)
    per_block = math.prod(cache.data.shape[1:])
    step = max(1, 2**26 // per_block)  # <= 256 MiB of fp32 scratch at a time
    for i in range(0, len(blocks), step):
        idx = torch.tensor(blocks[i : i + step], dtype=torch.long, device=cache.device)
        vals = torch.randn((len(idx), *cache.data.shape[1:]), generator=gen, device=cache.device) * 0.5
        if cache.data.element_size() == 1:  # fp8: write the bytes (index_put on uint8 works on every device)
            cache.data.view(torch.uint8)[idx] = vals.to(cache.data.dtype).view(torch.uint8)
        else:
            cache.data[idx] = vals.to(cache.data.dtype)
        if cache.scales is not None:
            cache.scales[idx] = 1.0


def load_average() -> list[float] | None:
    """1/5/15-minute load average: on a shared machine it says how much the timings were contended."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _mem_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 0.0
