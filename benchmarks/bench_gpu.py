"""`pdserve bench gpu`: does the engine run near the GPU's limits? One script, one device call.

Sections, in order (each has a time cap and the whole run a budget; results are written after
every section, so a run cut short still leaves its numbers):

  ceilings    device-to-device copy bandwidth, and `_scaled_mm` FP8 TFLOP/s at the model's GEMM
              shapes for M = 16 .. 16k (the two roofs, measured in this run)
  decode      CUDA-graph decode step, batch 1..256 at 4k context, against the memory floor
              (weight + KV bytes / measured copy bandwidth); `llama-3.1-8b`, then `llama-3.1-70b`
              (last: it needs the card to itself) at the batches that fit
  prefill     one prompt of 1k..32k tokens: time and MFU against the best measured FP8 rate
  green       decode ITL (batch 32, 4k) while 8k-token prefills run back to back: decode alone,
              colocated (one stream), two streams time-sharing the card, green-context SM splits
  hf          transformers LlamaForCausalLM, bf16, random weights, same config: 4k prefill and
              batch-32 decode at 4k context (the baseline a user would otherwise pick)
  transfer    671 MB (a 4k-token 70B prompt's FP8 KV) between two processes on the card: NIXL
              (UCX cuda_ipc) when pdserve's nixl transport and nixl are importable, else CUDA IPC
              through torch.multiprocessing, against the copy ceiling

All timings are CUDA events after warm-up; ratios compare numbers measured in the same run.
Random weights (seeded); KV pages hold random bytes (timing does not depend on their values).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from engine.cli import CliError

SECTIONS = ("ceilings", "decode", "prefill", "green", "hf", "transfer")
KV_TRANSFER_BYTES = 4096 * 80 * 2 * 8 * 128  # the article's 671 MB: 4k tokens of 70B FP8 K/V
CTX = 4096
TARGETS = {  # issue 7
    "decode_b64_8b_floor_fraction": 0.70,
    "prefill_4k_fp8_fraction": 0.50,
    "decode_b32_vs_hf": 5.0,
    "transfer_671mb_copy_fraction": 0.80,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    p.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b", help="decode/prefill presets (8b first)")
    p.add_argument("--budget-s", type=float, default=340.0, help="whole-run budget; sections past it are skipped")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--prefill-lens", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--green-sms", default="16,32,64", help="decode SM counts to try for the green split")
    p.add_argument("--out-dir", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--git-commit", default=None, help="record this commit (when .git is not on the machine)")


# ---- timing helpers ---------------------------------------------------------------------------
def cuda_time(fn: Callable[[], Any], reps: int = 10, warmup: int = 3, inner: int = 1) -> float:
    """Median seconds per call over `reps` samples of `inner` calls each (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(samples)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Budget:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# ---- ceilings -----------------------------------------------------------------------------------
def gemm_shapes(cfg) -> dict[str, tuple[int, int]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, cfg.q_size + 2 * cfg.kv_size), "o": (cfg.q_size, h), "gate_up": (h, 2 * i), "down": (i, h)}


def bench_ceilings(cfgs, cap_s: float) -> dict:
    from engine.kv_cache import FP8  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    n = 2 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    t = cuda_time(lambda: dst.copy_(src), reps=10)
    copy = {"bytes": n, "seconds": t, "copy_GBps_read_plus_write": 2 * n / t / 1e9, "copy_GBps_one_way": n / t / 1e9}
    del src, dst
    rows = []
    for cfg in cfgs:
        for name, (K, N) in gemm_shapes(cfg).items():
            w = torch.randn(N, K, device="cuda").to(FP8)
            sw = torch.rand(1, N, device="cuda") + 0.5
            for M in (16, 64, 256, 1024, 4096, 16384):
                if time.perf_counter() > end:
                    break
                x = torch.randn(M, K, device="cuda").to(FP8)
                sx = torch.rand(M, 1, device="cuda") + 0.5
                fn = lambda: torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)  # noqa: E731
                s = cuda_time(fn, reps=5, inner=max(1, 4096 // M))
                rows.append({"model": cfg.name, "gemm": name, "M": M, "K": K, "N": N, "seconds": s,
                             "TFLOPs": 2 * M * N * K / s / 1e12})
    return {"copy": copy, "scaled_mm": rows, "fp8_peak_TFLOPs": max((r["TFLOPs"] for r in rows), default=None)}


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
    from engine.kv_layout import KVLayout  # noqa: PLC0415
    from engine.model_runner import ModelRunner  # noqa: PLC0415

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
    from engine.kv_cache import KVCache  # noqa: PLC0415

    runner.cache_cfg, runner.layout = cache_cfg, KVLayout.build(cfg, cache_cfg)
    runner.cache = KVCache(runner.layout, "cuda")
    data = runner.layout.data_bytes_per_block
    runner.cache.raw[:, :data].random_(0, 0x70)  # finite e4m3 bytes (0x7f/0xff are NaN)
    runner.cache.raw[:, data:].view(torch.float32).fill_(0.02)
    return runner, fit, init_s


def bench_decode(runner, fit: list[int], copy_bw: float, cap_s: float) -> dict:
    from engine.gpu.cuda_graphs import DecodeGraphRunner  # noqa: PLC0415
    from engine.model_runner import StepItem  # noqa: PLC0415

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
        rows.append({"batch": B, "step_ms": t * 1e3, "tokens_per_s": B / t, "weight_bytes": wbytes, "kv_bytes": kv,
                     "floor_ms": floor * 1e3, "floor_fraction": floor / t, "achieved_GBps": (wbytes + kv) / t / 1e9})
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
    from engine.model_runner import StepItem  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    rows = []
    for T in lens:
        nbl = -(-T // 16)
        if nbl > runner.cache_cfg.num_blocks - 1 or time.perf_counter() > end:
            break
        item = StepItem(list(torch.randint(0, 1000, (T,)).tolist()), 0, list(range(nbl)))
        ids, pos, meta = runner._metadata([item])  # host-side preparation kept out of the GPU timing
        t = cuda_time(lambda: runner.model(ids, pos, runner.backend, runner.cache, meta), reps=3, warmup=1)
        fl = prefill_flops(runner.model_cfg, T)
        rows.append({"tokens": T, "ms": t * 1e3, "tokens_per_s": T / t, "TFLOPs": fl / t / 1e12,
                     "fraction_of_fp8_peak": (fl / t / 1e12 / fp8_peak) if fp8_peak else None})
    return rows


# ---- single-GPU disaggregation: decode ITL under prefill pressure ----------------------------
def bench_green(runner, graphs, sm_list: list[int], cap_s: float, B: int = 32, P: int = 8192,
                mode_s: float = 6.0) -> dict:
    from engine.gpu.green_contexts import SmPartition, green_contexts_supported  # noqa: PLC0415
    from engine.model_runner import StepItem  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    per_seq = CTX // 16
    if B not in graphs.graphs or B * per_seq + P // 16 >= runner.cache_cfg.num_blocks - 1:
        return {"skipped": f"needs a batch-{B} graph and room for a {P}-token prefill in the pool"}
    tables = torch.arange(B * per_seq, device="cuda").view(B, per_seq)
    graphs.replay(torch.randint(0, 1000, (B,), device="cuda"), torch.full((B,), CTX - 1, device="cuda"), tables)
    item = StepItem(torch.randint(0, 1000, (P,)).tolist(), 0, list(range(B * per_seq, B * per_seq + P // 16)))
    ids, pos, meta = runner._metadata([item])

    def prefill():
        runner.model(ids, pos, runner.backend, runner.cache, meta)

    def decode():
        graphs.graphs[B].replay()

    def measure(mode: str, part: SmPartition | None) -> dict:
        itl, done = [], [0]
        stop = threading.Event()
        t_end = time.perf_counter() + mode_s

        def prefill_loop(stream):
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    prefill()
                    stream.synchronize()
                    done[0] += 1

        th = None
        if part is not None:
            th = threading.Thread(target=prefill_loop, args=(part.prefill_stream,), daemon=True)
            th.start()
        stream = part.decode_stream if part is not None else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            last = time.perf_counter()
            while time.perf_counter() < t_end:
                if mode == "colocated":  # the article's freeze: the prefill runs instead of decode
                    prefill()
                    done[0] += 1
                decode()
                stream.synchronize()
                now = time.perf_counter()
                itl.append(now - last)
                last = now
        stop.set()
        if th is not None:
            th.join(60)
        ms = [x * 1e3 for x in itl[1:]]
        return {"mode": mode, "decode_sms": part.decode_sms if part and part.partitioned else None,
                "prefill_sms": part.prefill_sms if part and part.partitioned else None,
                "itl_p50_ms": pct(ms, 0.5), "itl_p90_ms": pct(ms, 0.9), "itl_p99_ms": pct(ms, 0.99),
                "decode_tokens_per_s": B * len(ms) / (sum(ms) / 1e3) if ms else None,
                "prefill_tokens_per_s": done[0] * P / mode_s, "steps": len(ms)}

    rows = [measure("decode_alone", None), measure("colocated", None), measure("two_streams", SmPartition.shared())]
    out: dict[str, Any] = {"batch": B, "context": CTX, "prefill_tokens": P, "rows": rows}
    if not green_contexts_supported():
        out["green"] = "not supported by this torch build or driver"
        return out
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    full = cuda_time(lambda: a @ a, reps=3)
    probe = []
    for d in sm_list:
        if time.perf_counter() + 2 * mode_s > end:
            break
        try:
            part = SmPartition.create(decode_sms=d)
            with torch.cuda.stream(part.prefill_stream):  # does the split bind? a GEMM slows ~ SM ratio
                slow_p = cuda_time(lambda: a @ a, reps=3) / full
            with torch.cuda.stream(part.decode_stream):
                probe.append({"decode_sms": part.decode_sms, "prefill_sms": part.prefill_sms, "how": part.how,
                              "decode_gemm_slowdown": cuda_time(lambda: a @ a, reps=3) / full,
                              "prefill_gemm_slowdown": slow_p})
                decode()  # graph replay on a green stream, checked before it is timed
            torch.cuda.synchronize()
            rows.append(measure("green", part))
        except Exception as e:  # noqa: BLE001 (report and go on: an API gap must not sink the run)
            out.setdefault("errors", []).append(f"green decode_sms={d}: {type(e).__name__}: {e}")
    out["sm_probe"] = probe
    return out


# ---- transformers baseline ----------------------------------------------------------------------
def bench_hf(preset: str, cap_s: float, B: int = 32) -> dict:
    import transformers  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from engine.config import PRESETS  # noqa: PLC0415

    end = time.perf_counter() + cap_s
    hf_cfg = LlamaConfig(**PRESETS[preset].to_hf_config())
    hf_cfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"transformers": transformers.__version__, "init_s": time.perf_counter() - t0,
                           "attn_implementation": "sdpa", "dtype": "bf16"}
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
        out.update({"decode_batch": B, "decode_context": CTX, "decode_step_ms": step * 1e3,
                    "decode_tokens_per_s": B / step})
    return out


# ---- KV transfer between two processes on the card ---------------------------------------------
def _ipc_producer(q, release, nbytes: int) -> None:
    """Child process: owns the source buffer; the parent maps it through CUDA IPC."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    torch.cuda.synchronize()
    q.put(src)
    release.get()


def bench_transfer(copy_one_way: float | None, cap_s: float) -> dict:
    out: dict[str, Any] = {"bytes": KV_TRANSFER_BYTES}
    try:
        import nixl  # noqa: F401,PLC0415

        from transport import nixl_backend  # noqa: F401,PLC0415
        out["nixl"] = "importable, but the device-memory NIXL run is not wired into this script yet"
    except ImportError as e:
        out["nixl"] = f"skipped: {e} (nixl is not on the device image; carry nixl-cu13 wheels to measure it)"
    ctx = torch.multiprocessing.get_context("spawn")
    q, release = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_producer, args=(q, release, KV_TRANSFER_BYTES), daemon=True)
    p.start()
    try:
        remote = q.get(timeout=cap_s)  # a tensor in the child's memory, opened via cudaIpcOpenMemHandle
        local = torch.empty_like(remote)
        t = cuda_time(lambda: local.copy_(remote), reps=10, warmup=2)
        ok = bool(torch.equal(local, remote))
        out["cuda_ipc"] = {"seconds": t, "GBps": KV_TRANSFER_BYTES / t / 1e9, "verified": ok,
                           "copy_fraction": (KV_TRANSFER_BYTES / t / 1e9) / copy_one_way if copy_one_way else None,
                           "how": "torch.multiprocessing CUDA IPC handle, device-to-device copy from a second process"}
        del remote
    finally:
        release.put(1)
        p.join(30)
    return out


# ---- driver -------------------------------------------------------------------------------------
def _ints(s: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise CliError(f"{flag} must be a comma list of integers, got {s!r}") from None


def _free_cuda() -> None:
    import gc  # noqa: PLC0415

    gc.collect()
    torch.cuda.empty_cache()


def check_targets(res: dict) -> list[dict]:
    s = res["sections"]
    got: dict[str, float | None] = dict.fromkeys(TARGETS)
    d8 = next((r for r in s.get("decode", {}).get("llama-3.1-8b", {}).get("rows", []) if r["batch"] == 64), None)
    got["decode_b64_8b_floor_fraction"] = d8 and d8["floor_fraction"]
    p4 = next((r for r in s.get("prefill", {}).get("llama-3.1-8b", []) if r["tokens"] == 4096), None)
    got["prefill_4k_fp8_fraction"] = p4 and p4["fraction_of_fp8_peak"]
    d32 = next((r for r in s.get("decode", {}).get("llama-3.1-8b", {}).get("rows", []) if r["batch"] == 32), None)
    hf = s.get("hf", {}).get("decode_tokens_per_s")
    got["decode_b32_vs_hf"] = d32["tokens_per_s"] / hf if d32 and hf else None
    got["transfer_671mb_copy_fraction"] = s.get("transfer", {}).get("cuda_ipc", {}).get("copy_fraction")
    return [{"target": k, "want_at_least": TARGETS[k], "measured": v,
             "pass": None if v is None else v >= TARGETS[k]} for k, v in got.items()]


def main(args: argparse.Namespace) -> int:
    from benchmarks.provenance import write_result  # noqa: PLC0415
    from engine.config import PRESETS  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise CliError("bench gpu needs a CUDA device (this machine has none); see benchmarks/gpu_device_run.sh")
    sections = [x for x in args.sections.split(",") if x]
    models = [x for x in args.models.split(",") if x]
    bad = [x for x in sections if x not in SECTIONS] + [m for m in models if m not in PRESETS]
    if bad or not models:
        raise CliError(f"unknown section/model {bad}; sections: {', '.join(SECTIONS)}; models: {', '.join(PRESETS)}")
    batches, lens, sms = _ints(args.batches, "--batches"), _ints(args.prefill_lens, "--prefill-lens"), \
        _ints(args.green_sms, "--green-sms")
    budget = Budget(args.budget_s)
    res: dict[str, Any] = {"targets": TARGETS, "sections": {}, "errors": {},
                           "device": torch.cuda.get_device_name(0), "source_commit": args.git_commit}
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    out_dir = Path(args.out_dir) if args.out_dir else None

    def save() -> None:
        write_result("gpu_bench", res, config=config, out_dir=out_dir)

    def run(name: str, cap: float, fn: Callable[[float], Any]) -> Any:
        cap = min(cap, budget.left())
        if cap < 10:
            res["errors"][name] = "skipped: run budget spent"
            return None
        t0 = time.perf_counter()
        print(f"[bench gpu] {name} (cap {cap:.0f}s, {budget.left():.0f}s left)", flush=True)
        try:
            return fn(cap)
        except Exception as e:  # noqa: BLE001 (one failed section must not lose the others' numbers)
            res["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"[bench gpu] {name} failed: {res['errors'][name]}", flush=True)
            return None
        finally:
            res.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
            save()

    cfgs = [PRESETS[m] for m in models]
    ceil = run("ceilings", 40, lambda cap: bench_ceilings(cfgs, cap)) if "ceilings" in sections else None
    if ceil:
        res["sections"]["ceilings"] = ceil
    copy_bw = ceil["copy"]["copy_GBps_read_plus_write"] * 1e9 if ceil else 4.3e12  # KINDS.md's reading if skipped
    fp8_peak = ceil and ceil["fp8_peak_TFLOPs"]
    first, rest = models[0], models[1:]
    need_runner = {"decode", "prefill", "green"} & set(sections)
    runner = graphs = None
    if need_runner:
        def decode_first(cap):
            nonlocal runner, graphs
            r, fit, init_s = build_runner(first, batches, extra_blocks=max(lens) // 16 if lens else 0, reserve_gb=12)
            runner = r
            d = bench_decode(r, fit, copy_bw, cap) if ({"decode", "green"} & set(sections)) else {"rows": []}
            graphs = d.pop("_graphs", None)
            d.update(init_s=init_s, num_blocks=r.cache_cfg.num_blocks)
            res["sections"].setdefault("decode", {})[first] = d
        run(f"decode:{first}", 150, decode_first)
    if runner is not None and "prefill" in sections:
        res["sections"]["prefill"] = {first: run(f"prefill:{first}", 60, lambda cap: bench_prefill(runner, lens, fp8_peak, cap))}
    if runner is not None and graphs is not None and "green" in sections:
        res["sections"]["green"] = run("green", 100, lambda cap: bench_green(runner, graphs, sms, cap))
    runner = graphs = None
    _free_cuda()
    if "hf" in sections:
        res["sections"]["hf"] = run("hf", 100, lambda cap: bench_hf(first, cap))
        _free_cuda()
    if "transfer" in sections:
        res["sections"]["transfer"] = run("transfer", 60, lambda cap: bench_transfer(
            ceil["copy"]["copy_GBps_one_way"] if ceil else None, cap))
    for m in rest if "decode" in sections else []:
        def decode_more(cap, m=m):
            r, fit, init_s = build_runner(m, [b for b in batches if b <= 64], extra_blocks=0, reserve_gb=6)
            d = bench_decode(r, fit, copy_bw, cap)
            d.pop("_graphs", None)
            d.update(init_s=init_s, num_blocks=r.cache_cfg.num_blocks)
            res["sections"].setdefault("decode", {})[m] = d
        run(f"decode:{m}", 150, decode_more)
        _free_cuda()
    res["target_check"] = check_targets(res)
    save()
    print_summary(res)
    return 0


def print_summary(res: dict) -> None:
    s = res["sections"]
    print(f"\n== bench gpu on {res['device']} ==")
    if "ceilings" in s:
        c = s["ceilings"]
        print(f"copy {c['copy']['copy_GBps_read_plus_write']:.0f} GB/s (read+write); "
              f"best _scaled_mm {c['fp8_peak_TFLOPs'] or float('nan'):.0f} TFLOP/s")
    for m, d in s.get("decode", {}).items():
        for r in d.get("rows", []):
            print(f"decode {m:14s} B={r['batch']:4d} step {r['step_ms']:7.2f} ms  floor {r['floor_ms']:7.2f} ms "
                  f"({r['floor_fraction']:.0%})  {r['tokens_per_s']:9.0f} tok/s")
    for m, rows in (s.get("prefill") or {}).items():
        for r in rows or []:
            print(f"prefill {m:13s} T={r['tokens']:6d} {r['ms']:8.1f} ms  {r['TFLOPs']:6.0f} TFLOP/s "
                  f"({(r['fraction_of_fp8_peak'] or 0):.0%} of FP8 peak)")
    for r in (s.get("green") or {}).get("rows", []):
        print(f"itl {r['mode']:13s} sms={r['decode_sms']}: p50 {r['itl_p50_ms']:.2f} p99 {r['itl_p99_ms']:.2f} ms, "
              f"prefill {r['prefill_tokens_per_s']:.0f} tok/s")
    if s.get("hf"):
        print(f"transformers: prefill 4k {s['hf'].get('prefill_4k_ms', float('nan')):.1f} ms, "
              f"decode B=32 {s['hf'].get('decode_tokens_per_s', float('nan')):.0f} tok/s")
    ipc = (s.get("transfer") or {}).get("cuda_ipc")
    if ipc:
        print(f"671 MB CUDA IPC: {ipc['GBps']:.0f} GB/s ({(ipc['copy_fraction'] or 0):.0%} of copy), verified={ipc['verified']}")
    for t in res.get("target_check", []):
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        m = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"target {t['target']:32s} >= {t['want_at_least']:<5} measured {m:>6}  {verdict}")
    for k, v in res.get("errors", {}).items():
        print(f"error {k}: {v}")


if __name__ == "__main__":
    import sys

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_gpu", description=__doc__.splitlines()[0])
    add_arguments(ap)
    try:
        sys.exit(main(ap.parse_args()))
    except CliError as e:
        print(f"bench gpu: error: {e}", file=sys.stderr)
        sys.exit(2)
