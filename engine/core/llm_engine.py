"""LLMEngine: continuous batching over one ModelRunner and one BlockManager.

Every `step()` runs one batch as a single forward pass: schedule -> run -> postprocess. The
`Scheduler` (engine/core/scheduler.py) chooses the batch, one token for each running (decoding)
sequence plus prefill work for waiting sequences (whole prompts or chunks of `chunk_size`
tokens), and hands it over as one `ScheduledBatch`; the engine runs it, samples, and appends
the tokens. The same engine serves three roles:

- colocated worker (and `pdserve generate`): prefill and decode on one pool;
- prefill worker (`prefill_only=True`): sequences stop after their first token and are *parked*
  with their KV blocks until `release()` (the decode side has pulled them, or the lease expired);
- decode worker: `add_prefilled()` admits a sequence whose KV was just pulled into local blocks.

KV blocks are given on demand: a prompt gets blocks chunk by chunk, a decoding sequence one
block each time it crosses a block boundary. When a running sequence needs a block and none is
free (nor cached, evictable), the most recently admitted sequence holding blocks is preempted by
recompute: its blocks go back (its full blocks stay cached, so the recompute is mostly cache
hits), and it waits at the head of the queue to prefill its prompt and generated tokens again,
then resumes decoding from its last sampled token, so no token is emitted twice. A waiting
prompt never preempts anyone: it waits for blocks.

Prefix caching (engine/kv/block_manager.py, engine/kv/prefix_cache.py): when a sequence starts (or
restarts) its prefill, the longest cached run of its full prompt blocks is reused and only the
rest is computed; every block a sequence fills is registered under its chained hash.

Running sequences live in a persistent `InputBatch` (engine/runner/input_batch.py): a decode step's
inputs are a few vectorized ops over its buffers, sampling happens on the logits' device, and
only the sampled ids come back to the host. A row takes its block ids from its sequence when it
joins (a preempted sequence rejoins with its new, possibly cache-shared, table) and appends one
each time its next token crosses into a block the sequence has grown since.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.request_logprobs import record_prompt_logprobs, sampled_logprobs
from engine.core.scheduler import PrefillChunk, ScheduledBatch, Scheduler
from engine.kv.block_manager import BlockManager, NoFreeBlocks
from engine.kv.prefix_cache import ROOT, block_hash, block_hashes
from engine.runner.input_batch import InputBatch
from engine.runner.model_runner import ModelRunner, StepItem
from engine.runner.sampler import SamplingRows
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
    seconds: float  # the whole step
    # sum over the step's items of new tokens x (start + new tokens): the attention score block
    # the step computes, the shape term the cost model's step fit prices (costmodel/fit/step_fit.py)
    attention_pairs: int = 0
    decode_pairs: int = 0  # of those, the decode rows' (memory-bound: the fit prices them apart)
    # the step split (`pdserve bench step`): host work vs the forward pass
    schedule_s: float = 0.0  # choosing the step's work, building the batch's inputs
    forward_s: float = 0.0  # the model (on CUDA: until its results are ready, see `sync`)
    sample_s: float = 0.0  # sampling on the device and the ids' trip to the host
    output_s: float = 0.0  # appending tokens, stop checks, leaving rows, events
    threads: int = 0  # CPU intra-op threads the forward ran with (ModelRunner.prompt_threads)
    prefill_seqs: int = 0  # prompt items (chunks) the step computed, each on its own attention path
    prefill_reads: int = 0  # sum over them of start + new tokens: the KV context each one read

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.sample_s + self.output_s


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        chunk_size: int | None = None,
        max_num_seqs: int = 256,
        max_prefill_tokens: int = 8192,
        prefill_only: bool = False,
        eos_ids: tuple[int, ...] = (),
        enable_prefix_caching: bool = True,
        reserve_budget: bool = False,
    ):
        self.runner = runner
        cache = runner.cache_cfg
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, enable_prefix_caching)
        self.max_context = runner.model_cfg.max_position_embeddings
        self.prefill_only = prefill_only
        # reserve prompt + max_tokens at a sequence's first chunk (the pre-on-demand policy; only
        # `pdserve bench kvcache` uses it, to measure what blocks on demand gain)
        self.reserve_budget = reserve_budget
        eos = runner.model_cfg.eos_token_id
        self.eos_ids = set(eos_ids) | ({eos} if eos is not None else set())
        max_blocks = min(self.blocks.blocks_for(self.max_context), cache.num_blocks)
        self.batch = InputBatch(max_num_seqs, max_blocks, cache.block_size, runner.device)  # decoding
        # a prefill worker reserves no output: its sequences stop after their first token
        reserve = reserve_budget and not prefill_only
        self.scheduler = Scheduler(self.blocks, self.batch, chunk_size, max_num_seqs, max_prefill_tokens, reserve)
        self.parked: dict[str, Sequence] = {}  # prefill_only: first token sampled, KV held
        self.last_step: StepStats | None = None  # the last step() call's figures; None if it ran nothing
        self.sync = False  # time the forward to completion (CUDA runs asynchronously); benchmarks set it

    # ---- the scheduler's state, read by the workers and the benchmarks -------------------------
    @property
    def running(self) -> list[Sequence]:
        """Decoding sequences, in batch row order (read-only: change them through the engine)."""
        return self.batch.seqs

    @property
    def waiting(self) -> deque[Sequence]:
        """Admitted sequences whose prompt is not fully cached yet, in queue order."""
        return self.scheduler.waiting

    @property
    def preempted(self) -> list[str]:
        """Ids preempted by the last step() (for timelines)."""
        return self.scheduler.preempted

    @property
    def preemptions(self) -> int:
        """Sequences preempted (by recompute) so far."""
        return self.scheduler.preemptions

    @property
    def chunk_size(self) -> int | None:
        return self.scheduler.chunk_size

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_prefill_tokens(self) -> int:
        return self.scheduler.max_prefill_tokens

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def _grow_running(self) -> None:
        """What the next step() does first (may preempt); idempotent there."""
        self.scheduler.grow_running()

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
        """Blocks for a disaggregated decode admission's prompt (decode grows them on demand;
        raises NoFreeBlocks if the pool is full). `max_tokens` is checked, not reserved."""
        return self.blocks.allocate(self.blocks.blocks_for(prompt_len))

    def reserve_cached(self, prompt_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Disaggregated decode admission with prefix caching: (blocks for the whole prompt, how
        many of them the local cache already holds first, their hashes). Only the rest must be
        pulled. Raises NoFreeBlocks, taking nothing, if the pool cannot hold the prompt."""
        bs = self.blocks.block_size
        hashes = block_hashes(prompt_ids, bs) if self.blocks.enable_caching else []
        hit = self.blocks.match(hashes)
        need = self.blocks.blocks_for(len(prompt_ids)) - len(hit)
        if not self.blocks.can_allocate(need + self.blocks.evictable(hit)):
            raise NoFreeBlocks(f"need {need} KV blocks, {self.blocks.num_free} free")
        self.blocks.acquire(hit)
        return hit + self.blocks.allocate(need), hit, hashes[: len(hit)]

    def add_prefilled(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in `seq.block_table` and whose first token
        is `seq.output_ids[0]` (disaggregated decode). `seq.block_hashes` names the blocks that
        came from the local cache; the pulled full blocks are registered here."""
        seq.num_cached = len(seq.prompt_ids)
        seq.status = Status.RUNNING
        self.scheduler.stamp_admitted(seq)
        self._commit_full_blocks(seq)
        if self._finish_if_done(seq):
            return
        self.batch.add(seq)

    def abort(self, seq_id: str) -> bool:
        """Drop a sequence wherever it is and free its blocks. True if it was found."""
        for s in self.waiting:
            if s.seq_id == seq_id:
                self.waiting.remove(s)
                self._free(s, "abort")
                return True
        for s in self.batch.seqs:
            if s.seq_id == seq_id:
                self.batch.remove(s)
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

    def step(self, on_layer: Callable[[ScheduledBatch, int], None] | None = None) -> list[TokenEvent]:
        """One forward pass: schedule -> run -> postprocess. `on_layer(batch, i)` runs once layer
        i of the step has written its KV (the prefill worker streams finished layers from it)."""
        t0 = time.perf_counter()
        work = self.scheduler.schedule()
        if work.is_empty:
            self.last_step = None  # nothing could run (idle, or every waiting prompt lacks blocks)
            return []
        inputs = self.batch.prepare() if work.decode else None
        items = [_step_item(c) for c in work.prefill]
        t1 = time.perf_counter()
        hook = None if on_layer is None else functools.partial(on_layer, work)
        logits = self.runner.execute(inputs, items, hook)
        if self.sync and logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        t2 = time.perf_counter()
        sampled = self._sample(work, logits)
        t3 = time.perf_counter()
        events = self._postprocess(work, sampled)
        t4 = time.perf_counter()
        # decode rows attend over context_lens (start + 1 each); prefill items as in the cost model
        decode_pairs = int(inputs.context_lens.sum()) if inputs is not None else 0
        pairs = decode_pairs + sum(len(it.token_ids) * (it.start_pos + len(it.token_ids)) for it in items)
        shape = (work.prefill_tokens, len(work.decode), t4 - t0, pairs, decode_pairs)  # then schedule, forward, ...
        reads = sum(it.start_pos + len(it.token_ids) for it in items)  # each prompt item's whole context
        times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        self.last_step = StepStats(*shape, *times, self.runner.last_threads, len(items), reads)
        return events

    def _sample(self, work: ScheduledBatch, logits: torch.Tensor) -> _Sampled:
        """Advance the prefills past their chunks and sample one token per row that asks for one.
        Rows of `logits`: the batch's rows, then the fresh prefills that finished their prompt."""
        for i, all_logits in self.runner.last_all_logits.items():  # echo: prompt logprobs, chunk by chunk
            record_prompt_logprobs(work.prefill[i].seq, all_logits)
        finished_prefill: list[Sequence] = []
        resumed: list[Sequence] = []  # recomputed after preemption: they rejoin the batch, sampling nothing now
        for chunk in work.prefill:
            seq = chunk.seq
            seq.num_cached += chunk.n
            self._commit_full_blocks(seq)
            if seq.num_cached == seq.prefill_target:
                (resumed if seq.output_ids else finished_prefill).append(seq)
        rows = self.batch.sampling_rows(logits.device) if work.decode else None
        if finished_prefill:
            extra = SamplingRows.build([s.params for s in finished_prefill], [0] * len(finished_prefill), logits.device)
            rows = extra if rows is None else rows.cat(extra)
        # the step's only device -> host copy: one id per row (none if only non-final chunks ran)
        ids = self.runner.sampler(logits, rows).cpu() if rows is not None else torch.empty(0, dtype=torch.long)
        tokens = ids.tolist()
        logprobs = sampled_logprobs(logits, [*work.decode, *finished_prefill], tokens)  # only rows that asked
        return _Sampled(ids, tokens, logprobs, finished_prefill, resumed)

    def _postprocess(self, work: ScheduledBatch, sampled: _Sampled) -> list[TokenEvent]:
        """Append the sampled tokens, finish what is done, move finished prefills out of the queue."""
        decode, tokens, logprobs = work.decode, sampled.tokens, sampled.logprobs
        events: list[TokenEvent] = []
        if decode:
            self.batch.advance(sampled.ids[: len(decode)])
        for seq, tok, lp in zip(decode, tokens, logprobs):
            seq.num_cached += 1
            self._commit_full_blocks(seq)  # before _finish_if_done frees the table
            seq.output_ids.append(tok)
            if lp is not None:
                seq.output_logprobs.append(lp)
            finished = self._finish_if_done(seq)
            events.append(TokenEvent(seq.seq_id, tok, len(seq.output_ids) - 1, finished, seq.finish_reason, lp))
        for seq, tok, lp in zip(sampled.finished_prefill, tokens[len(decode) :], logprobs[len(decode) :]):
            if lp is not None:
                seq.output_logprobs.append(lp)
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            seq.output_ids.append(tok)
            if self.prefill_only:
                seq.finish_reason = "prefilled"
                self.parked[seq.seq_id] = seq
                events.append(TokenEvent(seq.seq_id, tok, 0, False, None, lp))
                continue
            finished = self._finish_if_done(seq)
            if not finished:
                self.batch.add(seq)
            events.append(TokenEvent(seq.seq_id, tok, 0, finished, seq.finish_reason, lp))
        for seq in sampled.resumed:  # decode its last sampled token next step (after this step's rows moved)
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.batch.add(seq)
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
        if seq in self.batch:
            self.batch.remove(seq)
        self._free(seq, reason)
        return True

    def _commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks `seq` has filled since the last call under their chained hashes."""
        bs, done = self.blocks.block_size, len(seq.block_hashes)
        if not self.blocks.enable_caching or seq.num_cached // bs <= done:
            return
        parent = seq.block_hashes[-1] if done else ROOT
        for i in range(done, seq.num_cached // bs):
            parent = block_hash(parent, seq.tokens(i * bs, (i + 1) * bs))
            seq.block_hashes.append(parent)
            self.blocks.commit(seq.block_table[i], parent)

    def _free(self, seq: Sequence, reason: str) -> None:
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
            seq.block_hashes = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason


@dataclass
class _Sampled:
    """A step's sampling, for its postprocessing: ids (and the same as a list) row by row."""

    ids: torch.Tensor
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    finished_prefill: list[Sequence]  # fresh prefills that sampled their first token (rows after decode)
    resumed: list[Sequence]  # recomputed after preemption: they rejoin the batch, sampling nothing now


def _step_item(chunk: PrefillChunk) -> StepItem:
    """The model runner's view of one prefill chunk."""
    seq, start = chunk.seq, chunk.start
    return StepItem(
        seq.tokens(start, start + chunk.n),
        start,
        seq.block_table,
        want_logits=chunk.completes and not seq.output_ids,  # a resumed sequence samples nothing here
        # echo: logits of every prompt token, on the first (not a resumed) prefill
        all_logits=seq.params.prompt_logprobs is not None and not seq.output_ids,
    )
