"""ModelRunner: turns one step's work into one forward pass over the paged pool.

One call covers every case the workers need:
- decode rows of the persistent batch (`DecodeInputs`, one new token each),
- whole-prompt prefill (query_len = prompt length, nothing cached),
- chunked prefill (query_len = chunk, earlier chunks already cached),
- and any mix of them in one batch (colocated chunked prefill, Sarathi-style).

The step's inputs are built on the host with vectorized ops (one tensor per field per step, never
one per sequence) and moved to the device in one non-blocking copy each. Logits stay on the
device: the engine samples there (engine/runner/sampler.py). Decode-only steps replay a captured CUDA
graph when one is attached (`graphs`, set by the worker; see engine/gpu/cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.checkpoint.weights import build_model
from engine.config import PROMPT_STEP_TOKENS, CacheConfig, ModelConfig
from engine.kv.cache import KVCache
from engine.kv.layout import KVLayout
from engine.model.attention import AttentionBackend, AttentionMetadata
from engine.model.attention_registry import default_backend
from engine.model.linear import RowBuckets, resolve_host_gemm, row_buckets, set_row_buckets
from engine.model.llama import LlamaModel
from engine.runner.input_batch import DecodeInputs
from engine.runner.sampler import Sampler


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[int]:
    """Run the block on `n` intra-op threads (None: as it is) and put the count back after it;
    yields the count the block runs with. OpenMP keeps the count per calling thread."""
    own = torch.get_num_threads()
    if not n or n == own:
        yield own
        return
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(own)


@dataclass
class StepItem:
    token_ids: list[int]  # the new tokens of this sequence in this step
    start_pos: int  # tokens of this sequence already cached (position of token_ids[0])
    block_table: list[int]  # must already cover start_pos + len(token_ids) tokens
    want_logits: bool = True  # logits of the last new token (False for non-final prefill chunks)
    all_logits: bool = False  # also the logits of every new token (prompt logprobs), in `last_all_logits`


class DecodeGraphs(Protocol):
    """What the runner needs from captured decode graphs (engine/gpu/cuda_graphs.py has one)."""

    def fits(self, n: int, width: int) -> bool: ...

    def replay_step(self, step: DecodeInputs) -> torch.Tensor:
        """A decode-only step whose inputs are already on the device: its logits [n, vocab] fp32."""


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        cache_cfg: CacheConfig,
        weight_dtype: str = "fp8",
        device: str | torch.device = "cpu",
        checkpoint_dir: str | None = None,
        seed: int = 0,
        backend: AttentionBackend | None = None,
        row_buckets: RowBuckets | None = None,
        cpu_gemm: str | None = "fp32",
    ):
        """`row_buckets`: the process's CPU GEMM row buckets (process-wide, like the oneDNN caches
        they bound); None leaves them as they are (the default: 4 per octave, engine/model/linear.py).
        `cpu_gemm`: auto, fp32 or bf16, the dtype the model's CPU GEMMs multiply in (the default
        fp32 is a worker's default, so an in-process engine is an oracle for a served one)."""
        if row_buckets is not None:
            set_row_buckets(row_buckets)
        self.device = torch.device(device)
        self.model: LlamaModel = build_model(model_cfg, weight_dtype, self.device, checkpoint_dir, seed)
        if cpu_gemm is not None:
            self.model.set_cpu_gemm(resolve_host_gemm(cpu_gemm, weight_dtype, device))
        self.model_cfg, self.cache_cfg = model_cfg, cache_cfg
        self.layout = KVLayout.build(model_cfg, cache_cfg)
        self.cache = KVCache(self.layout, self.device)
        self.backend = backend or default_backend(self.device)
        self.sampler = Sampler(self.device)
        self.graphs: DecodeGraphs | None = None  # decode-only steps replay these when set
        self.graph_steps = 0  # decode steps that replayed a graph (tests and stats)
        self.last_all_logits: dict[int, torch.Tensor] = {}  # execute(): item index with all_logits -> [n, vocab]
        # CPU: intra-op threads for steps with PROMPT_STEP_TOKENS prompt tokens or more (None: the
        # thread's own count); last_threads: what the last execute() ran with
        self.prompt_threads: int | None = None
        self.prompt_min_tokens = PROMPT_STEP_TOKENS  # the fewest prompt tokens a step runs on them with
        self.last_threads = torch.get_num_threads()

    # ---- inputs ------------------------------------------------------------------------------
    def _prefill_inputs(self, items: list[StepItem]) -> DecodeInputs:
        """Flat inputs of prefill items: one tensor per field, positions and slots vectorized."""
        bs = self.cache_cfg.block_size
        for it in items:
            if (it.start_pos + len(it.token_ids) + bs - 1) // bs > len(it.block_table):
                raise ValueError(
                    f"block table of {len(it.block_table)} blocks cannot hold {it.start_pos + len(it.token_ids)} tokens"
                )
        qlens = torch.tensor([len(it.token_ids) for it in items], dtype=torch.long)
        starts = torch.tensor([it.start_pos for it in items], dtype=torch.long)
        width = max(len(it.block_table) for it in items)
        tables = torch.tensor([it.block_table + [0] * (width - len(it.block_table)) for it in items], dtype=torch.long)
        ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long)
        item = torch.repeat_interleave(torch.arange(len(items)), qlens)  # [T] which item each token is
        first = torch.repeat_interleave(qlens.cumsum(0) - qlens, qlens)  # [T] flat index of its item's first token
        pos = starts[item] + torch.arange(ids.shape[0]) - first
        slots = tables[item, pos // bs] * bs + pos % bs
        return DecodeInputs(ids, pos, slots, tables, (starts + qlens).to(torch.int32))

    def step_inputs(
        self, decode: DecodeInputs | None, items: list[StepItem]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A step's model inputs on the device: (token ids, positions, attention metadata), decode
        rows first. Public for the benchmarks that time the model's forward alone (benchmarks/gpu)."""
        parts = ([decode] if decode is not None else []) + ([self._prefill_inputs(items)] if items else [])
        qlens = [1] * (decode.input_ids.shape[0] if decode is not None else 0) + [len(it.token_ids) for it in items]
        if len(parts) == 1:
            x = parts[0]
        else:  # mixed step: decode rows first, then prefill items; tables padded to one width
            width = max(p.block_tables.shape[1] for p in parts)
            x = DecodeInputs(
                input_ids=torch.cat([p.input_ids for p in parts]),
                positions=torch.cat([p.positions for p in parts]),
                slots=torch.cat([p.slots for p in parts]),
                block_tables=torch.cat([F.pad(p.block_tables, (0, width - p.block_tables.shape[1])) for p in parts]),
                context_lens=torch.cat([p.context_lens for p in parts]),
            )
        dev = self.device

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev, non_blocking=True)

        ctx = move(x.context_lens)
        meta = AttentionMetadata(
            slot_mapping=move(x.slots),
            query_lens=qlens,
            context_lens=x.context_lens.tolist(),
            block_tables=move(x.block_tables),
            context_lens_t=ctx,
        )
        return move(x.input_ids), move(x.positions), meta

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, decode: DecodeInputs | None, items: list[StepItem], on_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Run one step: decode rows (if any) then prefill items. Returns fp32 logits on the device,
        [rows + items with want_logits, vocab], in that order. `on_layer(i)`: called once layer i
        has written the step's KV (on CUDA: once it is queued; the caller synchronizes)."""
        n_dec = 0 if decode is None else decode.input_ids.shape[0]
        self.last_all_logits = {}  # this step's, whichever path runs it (a replayed graph makes none)
        if not n_dec and not items:
            return torch.empty(0, self.model_cfg.vocab_size, device=self.device)
        input_ids, positions, meta = self.step_inputs(decode, items)
        if (
            on_layer is None
            and not items
            and self.graphs is not None
            and self.graphs.fits(n_dec, meta.block_tables.shape[1])
        ):
            self.graph_steps += 1
            self.last_threads = torch.get_num_threads()  # a replayed decode step runs on the loop's own count
            return self.graphs.replay_step(
                DecodeInputs(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.context_lens_t)
            )
        hidden = self._forward_with_threads(input_ids, positions, meta, on_layer, sum(meta.query_lens) - n_dec)
        if items:
            want = [True] * n_dec + [it.want_logits for it in items]
            last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1  # last new token of each row
            # Side output, rare (echo with logprobs): item index -> logits [n_new, vocab] on the device.
            for i, it in enumerate(items):
                if it.all_logits:
                    end = int(last[n_dec + i]) + 1
                    self.last_all_logits[i] = self.model.compute_logits(hidden[end - len(it.token_ids) : end])
            hidden = hidden[last[torch.tensor(want, device=self.device)]]
        return self.model.compute_logits(hidden)

    def _forward_with_threads(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None,
        prompt_tokens: int,
    ) -> torch.Tensor:
        """The model's forward [T, hidden], on `prompt_threads` intra-op threads when the step
        carries enough prompt tokens (the loop thread's count, set for the step and put back)."""
        want = self.prompt_threads if prompt_tokens >= self.prompt_min_tokens and self.device.type == "cpu" else None
        with intra_op_threads(want) as self.last_threads:
            return self.model(input_ids, positions, self.backend, self.cache, meta, on_layer)

    @torch.inference_mode()
    def warm_up(self, prompt_tokens: int = 64, decode_rows: tuple[int, ...] = (1, 2, 8)) -> float:
        """Run the shapes a first request meets before any request does; returns the seconds spent.

        Why: a fresh process builds each GEMM weight's layouts (FP8 dequantized and packed: ~0.5 GB
        for SmolLM2) and JIT-compiles oneDNN's kernels at the first step of each kind, so a new
        server's first request paid 1-2 s more than its tenth (issue 40). Here one prefill and a
        decode step per batch in `decode_rows` run into the pool's first blocks, and on CPU every
        GEMM row bucket once (`LlamaModel.warm_gemm_shapes`: oneDNN's caches full from the start,
        so worker memory stays flat under traffic of ever new lengths), at `prompt_threads` too. Nothing is
        allocated from the block manager: those blocks are free, and what is written there is
        overwritten by whoever is given them (a block's contents are never read before written)."""
        t0 = time.perf_counter()
        bs = self.cache_cfg.block_size
        n = min(prompt_tokens, self.model_cfg.max_position_embeddings - 1, (self.cache_cfg.num_blocks - 1) * bs)
        if n < 2:
            return 0.0
        table = list(range(-(-(n + 1) // bs)))
        ids = [i % self.model_cfg.vocab_size for i in range(n)]
        self.execute(None, [StepItem(ids, 0, table)])
        for rows in decode_rows:
            dec = DecodeInputs(
                input_ids=torch.zeros(rows, dtype=torch.long),
                positions=torch.full((rows,), n, dtype=torch.long),
                slots=torch.full((rows,), table[n // bs] * bs + n % bs, dtype=torch.long),
                block_tables=torch.tensor([table] * rows, dtype=torch.long),
                context_lens=torch.full((rows,), n + 1, dtype=torch.int32),
            )
            self.execute(dec, [])
        if self.device.type == "cpu":  # every GEMM row bucket, not only those the steps above met
            self.model.warm_gemm_shapes(row_buckets())
            if self.prompt_threads and self.prompt_threads != torch.get_num_threads():
                with intra_op_threads(self.prompt_threads):  # oneDNN keeps a kernel per thread count too
                    self.model.warm_gemm_shapes(row_buckets())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def forward(self, items: list[StepItem]) -> torch.Tensor:
        """Run one step of `items`; returns fp32 logits [n, vocab] on the host for the items with
        want_logits, in order (tests and benchmarks; the engine uses `execute`)."""
        return self.execute(None, items).cpu()
