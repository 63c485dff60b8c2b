"""The engine under a benchmark: one ModelRunner, KV pool and block manager, a decode batch with
pre-filled KV, and the device spec the cost model predicts with (`bench chunks`, `bench article`).

The harness reads the flags `benchmarks/bench_cli.add_common_arguments` defines.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from benchmarks.engine.device_probe import DeviceProbe, cpu_name, mem_bytes, probe_device

# Known GPUs -> datasheet preset of the cost model (substring of torch.cuda.get_device_name).
_GPU_DATASHEETS = (("H200", "h200"), ("H100", "h100-sxm"), ("B200", "b200"), ("A100", "a100-80g"))
_CUDA_MARGIN = 8e9  # activations, allocator slack, CUDA context


def cuda_kv_budget(cfg: Any, weight_dtype: str, device: torch.device) -> float:
    """Bytes left for the KV pool on `device` once `cfg`'s weights are loaded (rough, safe side)."""
    from costmodel.article import cost_model as cm  # noqa: PLC0415

    free = torch.cuda.mem_get_info(device)[0]
    m = cm.ModelSpec.from_config(cfg)
    # embedding and lm_head stay bf16 (engine/model/llama.py); the rest is in the weight dtype
    head = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    weights = cm.weight_bytes(m, weight_dtype) + head * 2
    return free - weights - _CUDA_MARGIN


def kv_pool_bytes(cfg: Any, kv_dtype: str, tokens: int, block_size: int = 16) -> int:
    from engine.config import CacheConfig  # noqa: PLC0415
    from engine.kv.layout import KVLayout  # noqa: PLC0415

    return KVLayout.build(cfg, CacheConfig(block_size, 1, kv_dtype)).block_bytes * -(-tokens // block_size)


def default_model(args: argparse.Namespace, device: torch.device, kv_tokens: int) -> str:
    """tiny on CPU; on CUDA the article's llama-3.1-70b if its weights plus `kv_tokens` of KV fit
    in free memory, else llama-3.1-8b."""
    if args.model is not None:
        return args.model
    if device.type != "cuda":
        return "tiny"
    from engine.config import PRESETS  # noqa: PLC0415
    from engine.generate_cli import kv_dtype_of  # noqa: PLC0415

    kv_dtype = kv_dtype_of(args)
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
        from costmodel.article import cost_model as cm  # noqa: PLC0415
        from engine.config import (  # noqa: PLC0415
            PRESETS,
            CacheConfig,
            is_checkpoint_dir,  # noqa: PLC0415
            resolve_model_config,
        )
        from engine.generate_cli import kv_dtype_of  # noqa: PLC0415
        from engine.kv.block_manager import BlockManager  # noqa: PLC0415
        from engine.runner.model_runner import ModelRunner  # noqa: PLC0415

        model = model or args.model
        if device.type == "cpu" and getattr(args, "threads", None) is None:
            args.threads = 1
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise CliError("--threads must be >= 1")
            torch.set_num_threads(args.threads)
        from engine.checkpoint.registry import PullError  # noqa: PLC0415
        from engine.checkpoint.registry import resolve as registry_resolve  # noqa: PLC0415

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
        kv_dtype = kv_dtype_of(args)
        cache = CacheConfig(block_size=16, num_blocks=-(-kv_tokens // 16) + pool_blocks, kv_dtype=kv_dtype)
        if device.type == "cuda":
            from engine.kv.layout import KVLayout  # noqa: PLC0415

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
        name = probe.device if device.type == "cuda" else f"cpu: {cpu_name()}"
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
                mem_bytes(device),
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
        from engine.runner.model_runner import StepItem  # noqa: PLC0415

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
