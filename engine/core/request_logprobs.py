"""The log probabilities a request asked to see (`logprobs`, `prompt_logprobs`), as the
`TokenLogprob` records its sequence keeps: the sampled tokens' for the rows that asked, and a
prompt's, chunk by chunk. The tensor work is engine/runner/logprobs.py's."""

from __future__ import annotations

import torch

from engine.runner.logprobs import token_logprobs
from engine.sequence import Sequence, TokenLogprob


def sampled_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
    """Each sampled token's logprob (+ top k) for the sequences that asked; None for the rest.
    Computed where the logits are; only the asking rows' values cross to the host."""
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


def record_prompt_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
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
