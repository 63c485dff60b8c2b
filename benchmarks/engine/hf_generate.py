"""transformers `generate` on the same prompts, beside the engine in `pdserve bench step`: the
reference its tokens are compared with and its speed set against."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine import toolkit as eb


def load_hf(model_dir: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (only for checkpoints)

    p = Path(model_dir)
    if p.suffix.lower() == ".gguf":
        return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval().to(device)
    gguf = {"gguf_file": "model.gguf"} if (p / "model.gguf").exists() and not any(p.glob("*.safetensors")) else {}
    return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, **gguf).eval().to(device)


@torch.inference_mode()
def run_hf(hf: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict[str, Any]:
    ids = torch.tensor(prompts, device=device)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    eb.sync(device)
    threads = torch.get_num_threads()  # recorded beside the engine's: the comparison is only fair at equal pools
    t0 = time.perf_counter()
    out = hf.generate(ids, **kw)
    eb.sync(device)
    total = time.perf_counter() - t0
    return {
        "e2e_s": total,
        "tokens_per_s": len(prompts) * new_tokens / total,
        "torch_threads": threads,
        "_ids": out[:, ids.shape[1] :].tolist(),
    }
