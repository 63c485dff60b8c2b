"""What a worker reports about its engine in its WorkerStats, beside its steps: the KV cache
manager's figures, the process's memory, how its CPU steps run. Safe off the loop thread."""

from __future__ import annotations

import os

import torch

from engine.core.llm_engine import LLMEngine
from engine.heap_trim import heap_usage


def compiled_graphs_of(engine: LLMEngine) -> int:
    """Decode-step graphs torch.compile built for this engine (0: eager, or CUDA graphs)."""
    graphs = engine.runner.graphs
    return int(getattr(graphs, "compiles", 0)) if engine.runner.device.type == "cpu" else 0


def cpu_gemm_of(engine: LLMEngine) -> str:
    """The dtype the engine's CPU GEMMs multiply in ("" on CUDA, where FP8 GEMMs are torch's own)."""
    return engine.runner.model.cpu_gemm if engine.runner.device.type == "cpu" else ""


def kv_figures(engine: LLMEngine) -> dict[str, int]:
    """The KV cache manager's figures every worker reports in its WorkerStats."""
    b = engine.blocks
    return {
        "blocks_total": b.num_blocks,
        "blocks_free": b.num_free,
        "blocks_cached": b.num_cached,
        "preemptions": engine.preemptions,
        "prefix_hit_blocks": b.hits,
        "prefix_lookup_blocks": b.lookups,
        "blocks_evicted": b.evictions,
    }


def memory_figures(engine: LLMEngine) -> dict[str, int]:
    """The worker process's memory for its WorkerStats: resident set (Linux /proc; 0 elsewhere),
    the C heap's bytes in use and free-but-kept (glibc), and, on CUDA, the caching allocator's
    reserved and allocated bytes. Safe off the loop thread."""
    dev = engine.runner.device
    cuda = dev.type == "cuda"
    in_use, free_kept = heap_usage()
    return {
        "rss_bytes": process_rss_bytes(),
        "heap_in_use_bytes": in_use,
        "heap_free_bytes": free_kept,
        "cuda_reserved_bytes": int(torch.cuda.memory_reserved(dev)) if cuda else 0,
        "cuda_allocated_bytes": int(torch.cuda.memory_allocated(dev)) if cuda else 0,
    }


def process_rss_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
