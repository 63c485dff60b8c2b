"""LLMEngine: continuous batching over one ModelRunner and one BlockManager.

Every `step()` builds one batch: one token for each running (decoding) sequence, plus prefill
work for waiting sequences, whole prompts or chunks of `chunk_size` tokens, and runs it as a
single forward pass. The same engine serves three roles:

- colocated worker (and `pdserve generate`): prefill and decode on one pool;
- prefill worker (`prefill_only=True`): sequences stop after their first token and are *parked*
  with their KV blocks until `release()` (the decode side has pulled them, or the lease expired);
- decode worker: `add_prefilled()` admits a sequence whose KV was just pulled into local blocks.

Blocks for a sequence's whole budget (prompt + max_tokens) are reserved at admission, so a
running sequence can never run out of KV mid-stream; a request that does not fit waits.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.logprobs import token_logprobs
from engine.model_runner import ModelRunner, StepItem
from engine.sampler import sample
from engine.sequence import Sequence, Status, TokenLogprob


@dataclass
class TokenEvent:
    seq_id: str
    token_id: int
    index: int  # 0 for the first generated token
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | None
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass
class StepStats:
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    # sum over the step's items of new tokens x (start + new tokens): the attention score block
    # the step computes, the shape term the cost model's step fit prices (costmodel/step_fit.py)
    attention_pairs: int = 0


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        chunk_size: int | None = None,
        max_num_seqs: int = 256,
        max_prefill_tokens: int = 8192,
        prefill_only: bool = False,
        eos_ids: tuple[int, ...] = (),
    ):
        self.runner = runner
        cache = runner.cache_cfg
        self.blocks = BlockManager(cache.num_blocks, cache.block_size)
        self.max_context = runner.model_cfg.max_position_embeddings
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_only = prefill_only
        eos = runner.model_cfg.eos_token_id
        self.eos_ids = set(eos_ids) | ({eos} if eos is not None else set())
        self.waiting: deque[Sequence] = deque()  # admitted, prompt not fully cached
        self.running: list[Sequence] = []  # decoding
        self.parked: dict[str, Sequence] = {}  # prefill_only: first token sampled, KV held
        self.last_step: StepStats | None = None  # the last step() call's figures; None if it ran nothing

    # ---- admission -------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("prompt must contain at least one token")
        total = prompt_len + (0 if self.prefill_only else max_tokens)
        if prompt_len + max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens"
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(
                f"request needs {self.blocks.blocks_for(total)} KV blocks; the pool has {self.blocks.num_blocks}"
            )

    def add_request(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt_ids), seq.params.max_tokens)
        self.waiting.append(seq)

    def reserve(self, prompt_len: int, max_tokens: int) -> list[int]:
        """Blocks for a disaggregated decode admission (raises NoFreeBlocks if the pool is full)."""
        return self.blocks.allocate(self.blocks.blocks_for(prompt_len + max_tokens))

    def add_prefilled(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in `seq.block_table` and whose first token
        is `seq.output_ids[0]` (disaggregated decode)."""
        seq.num_cached = len(seq.prompt_ids)
        seq.status = Status.RUNNING
        if self._finish_if_done(seq):
            return
        self.running.append(seq)

    def abort(self, seq_id: str) -> bool:
        """Drop a sequence wherever it is and free its blocks. True if it was found."""
        for queue in (self.waiting, self.running):
            for s in list(queue):
                if s.seq_id == seq_id:
                    queue.remove(s)
                    self._free(s, "abort")
                    return True
        return self.release(seq_id)

    def release(self, seq_id: str) -> bool:
        """prefill_only: free a parked sequence's blocks (decode pulled them, or lease expired)."""
        s = self.parked.pop(seq_id, None)
        if s is None:
            return False
        self._free(s, s.finish_reason or "released")
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def _schedule_prefill(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens this step) for waiting sequences, FIFO, within the step's prefill
        budget: `chunk_size` tokens when chunking, else whole prompts up to max_prefill_tokens
        (the first prompt always runs whole, however long)."""
        work: list[tuple[Sequence, int]] = []
        budget = self.chunk_size or self.max_prefill_tokens
        for seq in self.waiting:
            if budget <= 0 or len(self.running) + len(work) >= self.max_num_seqs:
                break
            if self.chunk_size is None:
                n = seq.prefill_remaining
                if work and n > budget:
                    break
            else:
                n = min(seq.prefill_remaining, budget)
            if not seq.block_table:  # first chunk: reserve the sequence's whole budget
                # prefill_only: the sampled first token is decoded (and cached) by the decode pool
                need = len(seq.prompt_ids) + (0 if self.prefill_only else seq.params.max_tokens)
                if not self.blocks.can_allocate(self.blocks.blocks_for(need)):
                    break  # head-of-line waits for blocks: keeps FIFO order
                self.blocks.grow(seq.block_table, need)
            work.append((seq, n))
            budget -= n
        return work

    def step(self) -> list[TokenEvent]:
        t0 = time.perf_counter()
        decode = list(self.running)
        prefill = self._schedule_prefill()
        # a running sequence always has a sampled token (its last, not yet cached); output_ids[-1]
        # avoids all_ids, which copies the whole prompt of every stream on every step
        items = [StepItem([s.output_ids[-1]], s.num_tokens - 1, s.block_table) for s in decode]
        for seq, n in prefill:
            done = seq.num_cached + n == len(seq.prompt_ids)
            items.append(
                StepItem(
                    seq.prompt_ids[seq.num_cached : seq.num_cached + n],
                    seq.num_cached,
                    seq.block_table,
                    want_logits=done,
                    all_logits=seq.params.prompt_logprobs is not None,
                )
            )
        if not items:
            self.last_step = None  # nothing could run (idle, or every waiting prompt lacks blocks)
            return []
        logits = self.runner.forward(items)
        for i, all_logits in self.runner.last_all_logits.items():  # echo: prompt logprobs, chunk by chunk
            seq, _ = prefill[i - len(decode)]
            _record_prompt_logprobs(seq, all_logits)
        # rows of `logits` follow items with want_logits: all decodes, then finished prefills
        sampled: list[Sequence] = list(decode)
        for seq, n in prefill:
            seq.num_cached += n
            if seq.num_cached == len(seq.prompt_ids):
                sampled.append(seq)
        tokens = sample(logits, [s.params for s in sampled], [s.num_sampled for s in sampled])
        logprobs = _logprobs(logits, sampled, tokens)
        events: list[TokenEvent] = []
        for seq, tok, lp in zip(sampled, tokens, logprobs):
            if lp is not None:
                seq.output_logprobs.append(lp)
            if seq.status == Status.WAITING:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                if not self.prefill_only:
                    self.running.append(seq)
            else:
                seq.num_cached += 1
            seq.output_ids.append(tok)
            if self.prefill_only:
                seq.finish_reason = "prefilled"
                self.parked[seq.seq_id] = seq
                events.append(TokenEvent(seq.seq_id, tok, 0, False, None, lp))
                continue
            finished = self._finish_if_done(seq)
            events.append(TokenEvent(seq.seq_id, tok, len(seq.output_ids) - 1, finished, seq.finish_reason, lp))
        pairs = sum(len(it.token_ids) * (it.start_pos + len(it.token_ids)) for it in items)
        self.last_step = StepStats(sum(n for _, n in prefill), len(decode), time.perf_counter() - t0, pairs)
        return events

    # ---- helpers ---------------------------------------------------------------------------
    def _finish_if_done(self, seq: Sequence) -> bool:
        tok, p = seq.output_ids[-1], seq.params
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_context:
            reason = "length"
        else:
            return False
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq, reason)
        return True

    def _free(self, seq: Sequence, reason: str) -> None:
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
    """Each sampled token's logprob (+ top k) for the sequences that asked; None for the rest."""
    asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not asked:
        return out
    rows = torch.tensor(asked, device=logits.device)
    k = max(seqs[i].params.logprobs or 0 for i in asked)
    chosen_t, ids_t, lps_t = token_logprobs(
        logits[rows], torch.tensor([tokens[i] for i in asked], device=logits.device), k
    )
    chosen, top_ids, top_lp = chosen_t.tolist(), ids_t.tolist(), lps_t.tolist()  # one host copy per tensor
    for j, i in enumerate(asked):
        n = seqs[i].params.logprobs or 0
        out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_ids[j][:n], top_lp[j][:n])))
    return out


def _record_prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """logits [n, V] of one prefill chunk: row r predicts prompt token start + r + 1."""
    start = len(seq.prompt_logprobs) - 1 if seq.prompt_logprobs else 0
    if not seq.prompt_logprobs:
        seq.prompt_logprobs.append(None)  # the first prompt token has no context to be predicted from
    targets = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    if not targets:
        return
    k = seq.params.prompt_logprobs or 0
    chosen, top_ids, top_lp = token_logprobs(logits[: len(targets)], torch.tensor(targets, device=logits.device), k)
    for t, c, ids, lps in zip(targets, chosen.tolist(), top_ids.tolist(), top_lp.tolist()):
        seq.prompt_logprobs.append(TokenLogprob(t, c, tuple(zip(ids, lps))))
