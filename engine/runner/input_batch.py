"""InputBatch: the running sequences' per-row state, kept between steps (vLLM v1's InputBatch).

Row i of every buffer belongs to `seqs[i]`. Buffers are preallocated for `max_rows` rows (pinned
host memory when the model runs on CUDA, so the step's inputs go over in non-blocking copies) and
updated from diffs, never rebuilt:

- a sequence joins as one new row (its blocks so far, context length, last token, sampling
  parameters);
- a decode step advances every row with vectorized ops (positions = context lengths; slots
  gathered from the block tables; the sampled ids become the next input ids);
- a row gets one more block id only when its next token crosses a block boundary (taken from its
  sequence's table, which the engine grows on demand);
- a leaving sequence's row is filled by the last row (compaction), so rows stay dense.

No step creates a tensor per sequence: per-row Python work happens only on join, leave and
block-boundary crossings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runner.sampler import SamplingRows, step_seed
from engine.sequence import Sequence


@dataclass
class DecodeInputs:
    """A decode step's inputs for the first `n` rows, on the host (pinned on CUDA); on the device
    when the runner hands a decode-only step to its graphs (`DecodeGraphs.replay_step`)."""

    input_ids: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long
    slots: torch.Tensor  # [n] long
    block_tables: torch.Tensor  # [n, width] long (width = blocks of the longest row)
    context_lens: torch.Tensor  # [n] int32 (positions + 1)


class InputBatch:
    def __init__(self, max_rows: int, max_blocks_per_row: int, block_size: int, device: torch.device):
        self.max_rows, self.block_size, self.device = max_rows, block_size, device
        pin = device.type == "cuda" and torch.cuda.is_available()

        def buf(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        self.seqs: list[Sequence] = []
        self.block_tables = buf(max_rows, max_blocks_per_row)
        self.num_blocks = buf(max_rows)  # block ids filled in each row's table
        self.lens = buf(max_rows)  # tokens cached per row = position of its next input token
        self.next_ids = buf(max_rows)  # each row's next input token (its last sampled one)
        self.temperature = buf(max_rows, dtype=torch.float32)
        self.top_p = buf(max_rows, dtype=torch.float32)
        self.top_k = buf(max_rows)
        self._rows: dict[str, int] = {}  # seq_id -> row
        self._random = 0  # rows with temperature > 0
        self._filtered = 0  # random rows with top-p/top-k

    def __len__(self) -> int:
        return len(self.seqs)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._rows

    # ---- join / leave ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A sequence whose prompt is cached and whose first token is sampled joins the batch."""
        r = len(self.seqs)
        if r >= self.max_rows:
            # a decode worker admits pulled sequences by blocks, not by max_num_seqs (blocks are
            # given on demand, so it can hold more streams than that): grow rather than fail
            self._grow(2 * self.max_rows)
        cached = seq.num_tokens - 1  # every token but the last sampled one has its K/V cached
        # the row's table is re-synced from the sequence on every join: a sequence preempted by
        # recompute comes back with a new table (its old blocks went back; some may now be shared
        # from the prefix cache). Blocks are given on demand, so the next token's block may not
        # exist yet: the engine grows the table before the next step and `prepare` appends it.
        nb = min(-(-(cached + 1) // self.block_size), len(seq.block_table))
        if -(-cached // self.block_size) > nb or nb > self.block_tables.shape[1]:
            raise ValueError(
                f"sequence {seq.seq_id} has {cached} tokens cached; its table has {len(seq.block_table)} blocks"
            )
        self.block_tables[r, :nb] = torch.tensor(seq.block_table[:nb], dtype=torch.long)
        self.num_blocks[r], self.lens[r], self.next_ids[r] = nb, cached, seq.output_ids[-1]
        p = seq.params
        self.temperature[r], self.top_p[r], self.top_k[r] = p.temperature, p.top_p, p.top_k
        self._count(seq, +1)
        self.seqs.append(seq)
        self._rows[seq.seq_id] = r

    def _grow(self, rows: int) -> None:
        """Reallocate every per-row buffer for `rows` rows, keeping the filled ones (rare)."""
        for name in ("block_tables", "num_blocks", "lens", "next_ids", "temperature", "top_p", "top_k"):
            old = getattr(self, name)
            new = torch.zeros((rows, *old.shape[1:]), dtype=old.dtype, pin_memory=old.is_pinned())
            new[: self.max_rows] = old
            setattr(self, name, new)
        self.max_rows = rows

    def remove(self, seq: Sequence) -> None:
        """The sequence leaves; the last row moves into its place."""
        r = self._rows.pop(seq.seq_id)
        self._count(seq, -1)
        last = len(self.seqs) - 1
        if r != last:
            moved = self.seqs[last]
            for b in (self.block_tables, self.num_blocks, self.lens, self.next_ids, self.temperature, self.top_p):
                b[r] = b[last]
            self.top_k[r] = self.top_k[last]
            self.seqs[r] = moved
            self._rows[moved.seq_id] = r
        self.seqs.pop()

    def _count(self, seq: Sequence, d: int) -> None:
        p = seq.params
        if p.temperature > 0:
            self._random += d
            if p.top_p < 1.0 or p.top_k > 0:
                self._filtered += d

    # ---- one decode step -------------------------------------------------------------------
    def prepare(self) -> DecodeInputs:
        """The inputs of a decode step over every row (vectorized; appends block ids at boundaries)."""
        n, bs = len(self.seqs), self.block_size
        lens = self.lens[:n]
        crossing = (lens // bs >= self.num_blocks[:n]).nonzero().flatten().tolist()
        for r in crossing:  # the next token starts a new block: append its id (once per block_size steps)
            table, nb, need = self.seqs[r].block_table, int(self.num_blocks[r]), int(lens[r]) // bs + 1
            if need > len(table) or need > self.block_tables.shape[1]:
                raise RuntimeError(f"sequence {self.seqs[r].seq_id} has no block for position {int(lens[r])}")
            self.block_tables[r, nb:need] = torch.tensor(table[nb:need], dtype=torch.long)
            self.num_blocks[r] = need
        width = int(self.num_blocks[:n].max()) if n else 0
        tables = self.block_tables[:n, :width]
        rows = torch.arange(n)
        slots = tables[rows, lens // bs] * bs + lens % bs
        return DecodeInputs(self.next_ids[:n], lens, slots, tables, (lens + 1).to(torch.int32))

    def advance(self, token_ids: torch.Tensor) -> None:
        """After a decode step: each row cached one more token; `token_ids` [n] (host) come next."""
        n = len(self.seqs)
        self.lens[:n] += 1
        self.next_ids[:n] = token_ids

    def sampling_rows(self, device: torch.device) -> SamplingRows:
        """The rows' sampling parameters (host buffers copied to `device`; seeds per seeded row)."""
        n = len(self.seqs)
        seeded = []
        if self._random:
            seeded = [
                (r, step_seed(s.params.seed, s.num_sampled))
                for r, s in enumerate(self.seqs)
                if s.params.seed is not None and s.params.temperature > 0
            ]
        return SamplingRows(
            temperature=self.temperature[:n].to(device, non_blocking=True),
            top_p=self.top_p[:n].to(device, non_blocking=True),
            top_k=self.top_k[:n].to(device, non_blocking=True),
            seeded=seeded,
            greedy=self._random == 0,
            filtered=self._filtered > 0,
        )
