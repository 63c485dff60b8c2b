"""ModelRunner: turns a list of (sequence, new tokens) into one forward pass over the paged pool.

One call covers every case the workers need:
- whole-prompt prefill (query_len = prompt length, nothing cached),
- chunked prefill (query_len = chunk, earlier chunks already cached),
- decode (query_len = 1),
- and any mix of them in one batch (colocated chunked prefill, Sarathi-style).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention_registry import default_backend
from engine.config import CacheConfig, ModelConfig
from engine.kv_cache import KVCache
from engine.kv_layout import KVLayout
from engine.model import LlamaModel
from engine.weights import build_model


@dataclass
class StepItem:
    token_ids: list[int]  # the new tokens of this sequence in this step
    start_pos: int  # tokens of this sequence already cached (position of token_ids[0])
    block_table: list[int]  # must already cover start_pos + len(token_ids) tokens
    want_logits: bool = True  # logits of the last new token (False for non-final prefill chunks)
    all_logits: bool = False  # also the logits of every new token (prompt logprobs), in `last_all_logits`


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
    ):
        self.device = torch.device(device)
        self.model_cfg, self.cache_cfg = model_cfg, cache_cfg
        self.model: LlamaModel = build_model(model_cfg, weight_dtype, self.device, checkpoint_dir, seed)
        self.layout = KVLayout.build(model_cfg, cache_cfg)
        self.cache = KVCache(self.layout, self.device)
        self.backend = backend or default_backend(self.device)
        self.last_all_logits: dict[int, torch.Tensor] = {}  # forward(): items with all_logits -> [n, vocab]

    def _metadata(self, items: list[StepItem]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.cache_cfg.block_size
        ids, pos, slots = [], [], []
        for it in items:
            n = len(it.token_ids)
            if (it.start_pos + n + bs - 1) // bs > len(it.block_table):
                raise ValueError(f"block table of {len(it.block_table)} blocks cannot hold {it.start_pos + n} tokens")
            ids += it.token_ids
            for p in range(it.start_pos, it.start_pos + n):
                pos.append(p)
                slots.append(it.block_table[p // bs] * bs + p % bs)
        max_blocks = max(len(it.block_table) for it in items)
        tables = torch.zeros(len(items), max_blocks, dtype=torch.long)
        for i, it in enumerate(items):
            tables[i, : len(it.block_table)] = torch.tensor(it.block_table, dtype=torch.long)
        ctx = [it.start_pos + len(it.token_ids) for it in items]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=[len(it.token_ids) for it in items],
            context_lens=ctx,
            block_tables=tables.to(dev),
            context_lens_t=torch.tensor(ctx, dtype=torch.int32, device=dev),
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def forward(self, items: list[StepItem]) -> torch.Tensor:
        """Run one step; returns fp32 logits [n, vocab] for the items with want_logits, in order."""
        if not items:
            return torch.empty(0, self.model_cfg.vocab_size)
        input_ids, positions, meta = self._metadata(items)
        hidden = self.model(input_ids, positions, self.backend, self.cache, meta)  # [T, hidden]
        last = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1  # last new token of each item
        want = torch.tensor([it.want_logits for it in items], device=self.device)
        # Side output, rare (echo with logprobs): item index -> logits [n_new, vocab] on the device.
        self.last_all_logits = {}
        for i, it in enumerate(items):
            if it.all_logits:
                end = int(last[i]) + 1
                self.last_all_logits[i] = self.model.compute_logits(hidden[end - len(it.token_ids) : end])
        return self.model.compute_logits(hidden[last[want]]).cpu()
