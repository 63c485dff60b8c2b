"""CUDA graphs for the decode step: one graph per batch size, replayed with padded batches.

A decode step of an 8B model launches ~10 kernels per layer; at small batch the GPU finishes
each faster than Python can launch the next, so the step measures the interpreter, not the
memory system. A captured graph replays the whole step (all layers and the logits) as one
launch.

What a graph needs: every input in a static buffer (ids, positions, slots, block tables,
context lengths), no host synchronisation and no data-dependent shapes inside. The decode path
of `CudaAttention` meets that (the split count depends only on the batch and the table width).
A batch of n sequences replays the smallest captured size B >= n; the B - n padding rows
write their K/V into `pad_block` (a block the caller keeps out of its allocator) and attend to
that one slot, so they never touch a live sequence.

In serving, the worker captures the graphs once at start (unless `--enforce-eager`) and attaches
them to its `ModelRunner` (`runner.graphs`): every decode-only step that fits replays a graph
through `replay_step`, with its host work (persistent batch, sampling) unchanged; steps with
prefill work run eagerly. `forward` keeps the older stand-in-for-a-runner use (benchmarks).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.llm_engine import LLMEngine
from engine.model.attention import AttentionMetadata
from engine.runner.input_batch import DecodeInputs
from engine.runner.model_runner import ModelRunner, StepItem

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphRunner:
    def __init__(
        self, runner: ModelRunner, max_context: int, pad_block: int, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    ):
        if runner.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"CUDA graphs need a CUDA device (the runner is on {runner.device})")
        if not 0 <= pad_block < runner.cache_cfg.num_blocks:
            raise ValueError(f"pad_block {pad_block} is outside the pool of {runner.cache_cfg.num_blocks} blocks")
        self.runner = runner
        self.bs = runner.cache_cfg.block_size
        self.max_blocks = -(-max_context // self.bs)
        self.pad_block = pad_block
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        dev, bmax = runner.device, max(self.batch_sizes)
        # static inputs: graphs read these addresses on every replay
        self.input_ids = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.positions = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.slots = torch.full((bmax,), pad_block * self.bs, dtype=torch.long, device=dev)
        self.tables = torch.full((bmax, self.max_blocks), pad_block, dtype=torch.long, device=dev)
        self.ctx = torch.ones(bmax, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # static outputs [B, vocab] fp32
        self.pool: Any = None  # the graphs' shared memory pool (torch's handle type is private)

    def __getattr__(self, name):  # stand in for the ModelRunner (model_cfg, cache_cfg, cache, ...)
        return getattr(self.runner, name)

    def _meta(self, B: int) -> AttentionMetadata:
        # Python lists are placeholders: the decode path reads only the device tensors.
        return AttentionMetadata(
            slot_mapping=self.slots[:B],
            query_lens=[1] * B,
            context_lens=[1] * B,
            block_tables=self.tables[:B],
            context_lens_t=self.ctx[:B],
        )

    def _run(self, B: int) -> torch.Tensor:
        r = self.runner
        hidden = r.model(self.input_ids[:B], self.positions[:B], r.backend, r.cache, self._meta(B))
        return r.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, sharing one memory pool."""
        self._reset_padding(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (Triton compile, cuBLAS handles) off the capture
            for B in self.batch_sizes:
                self._run(B)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for B in reversed(self.batch_sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[B] = self._run(B)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[B] = g
        torch.cuda.synchronize()

    def graph_size(self, n: int) -> int | None:
        return next((B for B in self.batch_sizes if B >= n), None)

    def fits(self, n: int, width: int) -> bool:
        """A decode step of n rows whose block tables are `width` wide can replay a graph."""
        return bool(self.graphs) and self.graph_size(n) is not None and width <= self.max_blocks

    @torch.inference_mode()
    def replay_step(self, step: DecodeInputs) -> torch.Tensor:
        """A decode step whose inputs the runner already built on the device (slots and context
        lengths included): copy them into the static buffers, pad, replay. Returns logits [n, vocab]
        fp32, a view of the graph's static output (valid until the next replay)."""
        n, width = step.input_ids.shape[0], step.block_tables.shape[1]
        B = self.graph_size(n)
        if B is None or width > self.max_blocks:
            raise ValueError(
                f"batch {n} x {width} blocks exceeds the captured graphs ({max(self.batch_sizes)} x {self.max_blocks})"
            )
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slots[:n].copy_(step.slots)
        self.tables[:n, :width].copy_(step.block_tables)
        self.tables[:n, width:].fill_(self.pad_block)
        self.ctx[:n].copy_(step.context_lens)
        self._reset_padding(n)
        self.graphs[B].replay()
        return self.logits[B][:n]

    def _reset_padding(self, n: int) -> None:
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slots[n:].fill_(self.pad_block * self.bs)
        self.tables[n:].fill_(self.pad_block)
        self.ctx[n:].fill_(1)

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Device tensors: input_ids, positions [n] long, block_tables [n, <= max_blocks] long.
        Returns logits [n, vocab] fp32 on the device (a view of the graph's static output: copy it
        before the next replay if you keep it)."""
        n = input_ids.shape[0]
        B = self.graph_size(n)
        if B is None or block_tables.shape[1] > self.max_blocks:
            raise ValueError(
                f"batch {n} x {block_tables.shape[1]} blocks exceeds the captured graphs "
                f"({max(self.batch_sizes)} x {self.max_blocks})"
            )
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.tables[:n, block_tables.shape[1] :].fill_(self.pad_block)
        rows = torch.arange(n, device=positions.device)
        self.slots[:n].copy_(self.tables[rows, positions // self.bs] * self.bs + positions % self.bs)
        self.ctx[:n].copy_(positions + 1)
        self._reset_padding(n)
        self.graphs[B].replay()
        return self.logits[B][:n]

    @torch.inference_mode()
    def forward(self, items: list[StepItem]) -> torch.Tensor:
        """Drop-in for ModelRunner.forward: graphs for decode-only batches that fit, else eager."""
        n = len(items)
        fits = (
            n > 0
            and all(len(it.token_ids) == 1 and it.want_logits for it in items)
            and self.graph_size(n) is not None
            and max(len(it.block_table) for it in items) <= self.max_blocks
        )
        if not fits or not self.graphs:
            return self.runner.forward(items)
        dev = self.runner.device
        width = max(len(it.block_table) for it in items)
        tables = torch.full((n, width), self.pad_block, dtype=torch.long)
        for i, it in enumerate(items):
            tables[i, : len(it.block_table)] = torch.tensor(it.block_table, dtype=torch.long)
        ids = torch.tensor([it.token_ids[0] for it in items], dtype=torch.long)
        pos = torch.tensor([it.start_pos for it in items], dtype=torch.long)
        return self.replay(ids.to(dev), pos.to(dev), tables.to(dev)).cpu()


def attach_decode_graphs(engine: LLMEngine, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> DecodeGraphRunner:
    """Capture decode graphs for a serving engine and attach them to its runner: from then on
    every decode-only step of up to `engine.max_num_seqs` rows replays one (padded to the next
    captured size). One KV block is taken from the engine's allocator for good as the padding
    rows' scratch block, so padding never writes into a live sequence's pages."""
    runner = engine.runner
    pad = engine.blocks.allocate(1)[0]
    sizes = tuple(b for b in batch_sizes if b < engine.max_num_seqs) + (engine.max_num_seqs,)
    max_context = min(engine.max_context, runner.cache_cfg.num_blocks * runner.cache_cfg.block_size)
    graphs = DecodeGraphRunner(runner, max_context=max_context, pad_block=pad, batch_sizes=sizes)
    graphs.capture()
    runner.graphs = graphs
    return graphs
