"""`bench gpu` engine sections: pdserve's CUDA-graph decode step against the memory floor, prefill
against the measured FP8 rate, and transformers' LlamaForCausalLM as the baseline."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.gpu.ceilings import gemm_shapes
from benchmarks.gpu.timing import CTX, cuda_time


# ---- the engine on the GPU --------------------------------------------------------------------
def weight_bytes_per_step(model) -> int:
    """Bytes a decode step must read: every linear's weights and scales, the lm_head, norms."""
    total = 0
    for buf in model.buffers():
        total += buf.numel() * buf.element_size()
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    total += head.numel() * head.element_size()
    total -= sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("inv_freq"))
    return total + sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)


def build_runner(preset: str, batches: list[int], extra_blocks: int, reserve_gb: float):
    """The model, then a pool as large as the biggest decode batch (4k each) needs and memory allows."""
    from engine.config import PRESETS, CacheConfig  # noqa: PLC0415
    from engine.gpu.attention import CudaAttention  # noqa: PLC0415
    from engine.kv.layout import KVLayout  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415

    cfg = PRESETS[preset]
    t0 = time.perf_counter()
    small = CacheConfig(block_size=16, num_blocks=1)
    runner = ModelRunner(cfg, small, weight_dtype="fp8", device="cuda", backend=CudaAttention())
    torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    per_block = KVLayout.build(cfg, small).block_bytes
    free = torch.cuda.mem_get_info()[0] - reserve_gb * 2**30
    fit = [b for b in batches if (b * CTX // 16 + extra_blocks + 1) * per_block < free]
    nb = max(fit, default=0) * CTX // 16 + extra_blocks + 1
    nb = min(nb, int(free // per_block))
    cache_cfg = CacheConfig(block_size=16, num_blocks=nb)
    del runner.cache
    from engine.kv.cache import KVCache  # noqa: PLC0415

    runner.cache_cfg, runner.layout = cache_cfg, KVLayout.build(cfg, cache_cfg)
    runner.cache = KVCache(runner.layout, "cuda")
    data = runner.layout.data_bytes_per_block
    runner.cache.raw[:, :data].random_(0, 0x70)  # finite e4m3 bytes (0x7f/0xff are NaN)
    runner.cache.raw[:, data:].view(torch.float32).fill_(0.02)
    return runner, fit, init_s


def bench_decode(runner, fit: list[int], copy_bw: float, cap_s: float) -> dict:
    from engine.gpu.cuda_graphs import DecodeGraphRunner  # noqa: PLC0415
    from engine.runner.model_runner import StepItem  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    nb = runner.cache_cfg.num_blocks
    per_seq = CTX // 16
    graphs = DecodeGraphRunner(runner, max_context=CTX, pad_block=nb - 1, batch_sizes=tuple(fit))
    t0 = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t0
    wbytes = weight_bytes_per_step(runner.model)
    rows = []
    for B in fit:
        if time.perf_counter() > end:
            break
        tables = torch.arange(B * per_seq, device="cuda").view(B, per_seq)
        ids = torch.randint(0, 1000, (B,), device="cuda")
        pos = torch.full((B,), CTX - 1, device="cuda")
        graphs.replay(ids, pos, tables)
        t = cuda_time(graphs.graphs[B].replay, reps=10, warmup=2)
        kv = B * CTX * runner.layout.bytes_per_token
        floor = (wbytes + kv) / copy_bw  # copy_bw: bytes read + written per second, the DRAM traffic rate
        rows.append(
            {
                "batch": B,
                "step_ms": t * 1e3,
                "tokens_per_s": B / t,
                "weight_bytes": wbytes,
                "kv_bytes": kv,
                "floor_ms": floor * 1e3,
                "floor_fraction": floor / t,
                "achieved_GBps": (wbytes + kv) / t / 1e9,
            }
        )
    eager = None
    if 64 in fit and time.perf_counter() < end:  # what the same step costs without graphs (host included)
        items = [StepItem([1], CTX - 1, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(64)]
        eager = cuda_time(lambda: runner.forward(items), reps=3, warmup=1) * 1e3
    return {"graph_capture_s": capture_s, "rows": rows, "eager_engine_step_b64_ms": eager, "_graphs": graphs}


def prefill_flops(cfg, T: int) -> float:
    linear = sum(K * N for K, N in gemm_shapes(cfg).values()) * cfg.num_layers
    attn = 2 * cfg.num_heads * cfg.head_dim * T * T * cfg.num_layers  # QK^T and PV, causal half
    return 2.0 * linear * T + attn  # the timed call stops at the final norm (no lm_head)


def bench_prefill(runner, lens: list[int], fp8_peak: float | None, cap_s: float) -> list[dict]:
    from engine.runner.model_runner import StepItem  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    rows = []
    for T in lens:
        nbl = -(-T // 16)
        if nbl > runner.cache_cfg.num_blocks - 1 or time.perf_counter() > end:
            break
        item = StepItem(list(torch.randint(0, 1000, (T,)).tolist()), 0, list(range(nbl)))
        ids, pos, meta = runner.step_inputs(None, [item])  # host-side preparation kept out of the GPU timing
        t = cuda_time(lambda: runner.model(ids, pos, runner.backend, runner.cache, meta), reps=3, warmup=1)
        fl = prefill_flops(runner.model_cfg, T)
        rows.append(
            {
                "tokens": T,
                "ms": t * 1e3,
                "tokens_per_s": T / t,
                "TFLOPs": fl / t / 1e12,
                "fraction_of_fp8_peak": (fl / t / 1e12 / fp8_peak) if fp8_peak else None,
            }
        )
    return rows


# ---- transformers baseline ----------------------------------------------------------------------
def bench_hf(preset: str, cap_s: float, B: int = 32) -> dict:
    import transformers  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from engine.config import PRESETS  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    # attn_implementation: PretrainedConfig's documented keyword (not in LlamaConfig's typed signature)
    hf_cfg = LlamaConfig(**{**PRESETS[preset].to_hf_config(), "attn_implementation": "sdpa"})
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    torch.cuda.synchronize()
    out: dict[str, Any] = {
        "transformers": transformers.__version__,
        "init_s": time.perf_counter() - t0,
        "attn_implementation": "sdpa",
        "dtype": "bf16",
    }
    with torch.inference_mode():
        ids = torch.randint(0, 1000, (1, CTX), device="cuda")
        t = cuda_time(lambda: model(ids, use_cache=False, logits_to_keep=1), reps=3, warmup=1)
        out["prefill_4k_ms"] = t * 1e3
        if time.perf_counter() > end:
            return out
        res = model(torch.randint(0, 1000, (B, CTX), device="cuda"), use_cache=True, logits_to_keep=1)
        cache, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = model(nxt, past_key_values=cache, use_cache=True)
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
        step = statistics.median(steps[2:])
        out.update(
            {"decode_batch": B, "decode_context": CTX, "decode_step_ms": step * 1e3, "decode_tokens_per_s": B / step}
        )
    return out
