"""Scheduler: decides each engine step's work, and hands it over as one `ScheduledBatch`.

A step's work is one token for each running (decoding) sequence, plus prefill work for waiting
sequences: whole prompts up to `max_prefill_tokens`, or chunks of `chunk_size` tokens. The
scheduler owns the waiting queue and the decisions around it:

- growth: each running sequence gets the block its next token needs, oldest first;
- preemption (by recompute): when none is free, the most recently admitted holder gives back
  every block (full ones stay cached) and waits at the head of the queue; its output is kept, so
  its stream resumes where it stopped;
- admission and chunking: waiting sequences, FIFO, within the step's prefill budget and the
  batch's row limit; a first chunk reuses the longest cached run of the prompt's full blocks. A
  prompt whose blocks the pool cannot give stops the scan (head-of-line waits, keeping FIFO
  order); a waiting prompt never preempts anyone.

It changes block tables and the queue, never token ids or outputs: running the batch and
reading its results back (appending tokens, finishing, rows joining the batch) is the engine's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv.block_manager import BlockManager
from engine.kv.prefix_cache import block_hashes
from engine.runner.input_batch import InputBatch
from engine.sequence import Sequence, Status


@dataclass(frozen=True)
class PrefillChunk:
    """`n` prompt (or, after preemption, prompt + output) tokens of `seq` from position `start`."""

    seq: Sequence
    start: int
    n: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the end of the sequence's prefill target."""
        return self.start + self.n == self.seq.prefill_target


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: decode rows in batch row order, then the prefill chunks in queue order."""

    decode: tuple[Sequence, ...]
    prefill: tuple[PrefillChunk, ...]
    preempted: tuple[str, ...]  # ids preempted while scheduling this step

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def prefill_tokens(self) -> int:
        return sum(c.n for c in self.prefill)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        batch: InputBatch,
        chunk_size: int | None,
        max_num_seqs: int,
        max_prefill_tokens: int,
        reserve_budget: bool,
    ):
        self.blocks = blocks
        self.batch = batch  # the running (decoding) sequences' rows; the engine adds finished prefills
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        # reserve prompt + max_tokens at a sequence's first chunk (the pre-on-demand policy; only
        # `pdserve bench kvcache` uses it, to measure what blocks on demand gain)
        self.reserve_budget = reserve_budget
        self.waiting: deque[Sequence] = deque()  # admitted, prompt not fully cached
        self.preemptions = 0  # sequences preempted (by recompute) so far
        self.preempted: list[str] = []  # ids preempted by the last schedule()
        self.admissions = 0  # counter behind Sequence.admitted

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.batch.seqs)

    def schedule(self) -> ScheduledBatch:
        """This step's work. Gives the blocks it needs (preempting if it must) and moves nothing
        between queues: a finished prefill stays in `waiting` until the engine moves it."""
        self.preempted = []
        self.grow_running()
        decode = tuple(self.batch.seqs)
        prefill = tuple(PrefillChunk(seq, seq.num_cached, n) for seq, n in self._schedule_prefill())
        return ScheduledBatch(decode, prefill, tuple(self.preempted))

    def stamp_admitted(self, seq: Sequence) -> None:
        seq.admitted = self.admissions
        self.admissions += 1

    # ---- growth and preemption -------------------------------------------------------------
    def _holders(self) -> list[Sequence]:
        """Sequences holding blocks that preemption may take back: running ones and partly
        prefilled waiting ones (parked prefills are leased to a decode worker: never)."""
        return self.batch.seqs + [s for s in self.waiting if s.block_table]

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: give back every block (full ones stay cached) and wait at the
        head of the queue; output_ids are kept, so the stream resumes where it stopped."""
        if seq in self.batch:
            self.batch.remove(seq)  # its row goes; it rejoins with its new block table
            self.waiting.appendleft(seq)
        self.blocks.free(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_cached = [], [], 0
        if not seq.output_ids:
            seq.prompt_logprobs = []  # its prefill starts again from token 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.preempted.append(seq.seq_id)

    def grow_running(self) -> None:
        """Give each running sequence (oldest first) the block its next token needs, preempting
        the most recently admitted holder while none is free (possibly the sequence itself).
        Batch rows are compacted when one leaves, so the order comes from `admitted`."""
        needy = [s for s in self.batch.seqs if self.blocks.blocks_for(s.num_tokens) > len(s.block_table)]
        for seq in sorted(needy, key=lambda s: s.admitted):
            if seq.status != Status.RUNNING:  # preempted for an older sequence's block
                continue
            need = self.blocks.blocks_for(seq.num_tokens) - len(seq.block_table)
            while not self.blocks.can_allocate(need):
                victim = max(self._holders(), key=lambda s: s.admitted)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                self.blocks.grow(seq.block_table, seq.num_tokens)

    # ---- admission and chunking ------------------------------------------------------------
    def _cache_hit(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """(cached blocks, their hashes): the longest cached run of `seq`'s full blocks, leaving at
        least one token to compute (its logits sample the next token). Takes no references."""
        if not self.blocks.enable_caching or seq.params.prompt_logprobs is not None:
            return [], []  # echo needs the logits of every prompt token: compute them all
        hashes = block_hashes(seq.tokens(0, seq.prefill_target - 1), self.blocks.block_size)
        hit = self.blocks.match(hashes)
        return hit, hashes[: len(hit)]

    def _give_blocks(self, seq: Sequence, n: int, hit: list[int], hashes: list[int]) -> bool:
        """Blocks for `seq`'s next `n` prefill tokens (after the cache hit, on its first chunk).
        False, taking nothing, if the pool cannot give them now."""
        start = seq.num_cached if seq.block_table else len(hit) * self.blocks.block_size
        end = start + n
        if self.reserve_budget:  # up-front reservation: bench kvcache's baseline
            end = max(end, len(seq.prompt_ids) + seq.params.max_tokens)
        need = self.blocks.blocks_for(end) - (len(seq.block_table) or len(hit))
        if not self.blocks.can_allocate(need + self.blocks.evictable(hit)):
            return False
        if not seq.block_table:
            self.blocks.acquire(hit)
            seq.block_table, seq.block_hashes, seq.num_cached = list(hit), list(hashes), start
            if not seq.output_ids:
                seq.cached_tokens = start
            self.stamp_admitted(seq)
        self.blocks.grow(seq.block_table, end)
        return True

    def _schedule_prefill(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens this step) for waiting sequences, FIFO, within the step's prefill
        budget: `chunk_size` tokens when chunking, else whole prompts up to max_prefill_tokens
        (the first prompt always runs whole, however long)."""
        work: list[tuple[Sequence, int]] = []
        budget = self.chunk_size or self.max_prefill_tokens
        for seq in self.waiting:
            if budget <= 0 or len(self.batch) + len(work) >= self.max_num_seqs:
                break
            hit, hashes = self._cache_hit(seq) if not seq.block_table else ([], [])
            remaining = seq.prefill_target - (seq.num_cached if seq.block_table else len(hit) * self.blocks.block_size)
            if self.chunk_size is None:
                n = remaining
                if work and n > budget:
                    break
            else:
                n = min(remaining, budget)
            if not self._give_blocks(seq, n, hit, hashes):
                break
            work.append((seq, n))
            budget -= n
        return work
