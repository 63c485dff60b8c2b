"""A request trace for `pdserve plan --trace FILE`: one JSON object a line.

    {"arrival_s": 0.0, "prompt_tokens": 2048, "output_tokens": 8}
    {"arrival_s": 0.5, "prompt_tokens": 600, "output_tokens": 256, "kind": "chat",
     "prefix_id": "sys-1", "prefix_tokens": 512}

`arrival_s` is the offset from the trace's start. `kind` ("chat" or "document") says which
requests' prefills count as stalls of the others (costmodel/serve_metrics.py); without it a
prompt of `DOCUMENT_TOKENS` or more is a document. `prefix_id` names a prompt prefix shared
with the other requests of that id (a system prompt, a document asked about again) and
`prefix_tokens` how long it is: the simulator's workers cache it as the engine does (whole
blocks). A `prefix_id` without `prefix_tokens` says nothing of the length: it is counted, not
modelled, and the plan says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from costmodel.workloads import RequestKind, RequestSpec

DOCUMENT_TOKENS = 1024


def read_trace(path: Path) -> tuple[list[RequestSpec], int]:
    """(the requests in arrival order, how many carry a prefix_id without prefix_tokens: not
    modelled). ValueError names the bad line."""
    specs: list[RequestSpec] = []
    shared = 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival, prompt, output = float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}:{n}: want {{arrival_s, prompt_tokens, output_tokens}} as JSON ({type(e).__name__}: {e})"
            ) from None
        given = row.get("kind")
        kind: RequestKind = (
            "document" if given == "document" or (given is None and prompt >= DOCUMENT_TOKENS) else "chat"
        )
        if arrival < 0 or prompt < 1 or output < 1 or given not in (None, "chat", "document"):
            raise ValueError(f"{path}:{n}: arrival_s >= 0, tokens >= 1 and kind chat or document, please")
        prefix_id, prefix_len = _prefix(row, prompt, f"{path}:{n}")
        shared += "prefix_id" in row and prefix_id is None
        specs.append(RequestSpec(f"trace-{n}", (1,) * prompt, prompt, output, arrival, kind, prefix_id, prefix_len))
    if not specs:
        raise ValueError(f"{path}: no requests")
    return sorted(specs, key=lambda s: s.arrival_s), shared


def _prefix(row: dict, prompt: int, where: str) -> tuple[str | None, int]:
    """(prefix id, its length in this prompt) where the row gives both; (None, 0) otherwise."""
    if row.get("prefix_id") is None or row.get("prefix_tokens") is None:
        return None, 0
    try:
        n = int(row["prefix_tokens"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: prefix_tokens must be a whole number of tokens") from None
    if not 0 <= n <= prompt:
        raise ValueError(f"{where}: prefix_tokens must be 0 to prompt_tokens ({prompt})")
    return str(row["prefix_id"]), n
