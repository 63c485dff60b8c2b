"""Log probabilities of chosen tokens and their top alternatives, as tensors where the logits are.

Pure tensor code, no Python loop over the batch: a device sampler calls it on the logits it
already holds, so only B chosen values plus B x k alternatives cross to the host, and only for
the requests that asked. Values are the model's own distribution (log_softmax of the raw
logits, before temperature or top-p), as vLLM and the OpenAI API report them.
"""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], token_ids [B] (long) -> chosen [B] fp32, top_ids [B, k] long, top_logprobs [B, k] fp32,
    all on the logits' device; top-k sorted by logprob, descending (k = 0 gives [B, 0])."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, token_ids.long().view(-1, 1)).squeeze(1)  # [B]
    if k <= 0:
        empty = logp.new_empty(logp.shape[0], 0)
        return chosen, empty.long(), empty
    top_lp, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [B, k]
    return chosen, top_ids, top_lp


__all__ = ["token_logprobs"]
