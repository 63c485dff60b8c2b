"""Weights: seeded random initialisation for presets, or a Hugging Face Llama checkpoint
(config.json + *.safetensors, or a GGUF file) quantized to FP8 at load time.

Random weights are scaled so every layer keeps activations O(1) and the logits spread with a
standard deviation of ~4: greedy choices then have clear margins, so the equality oracles
(batching, chunking, processes, transports) compare real decisions, not rounding noise.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model.llama import LlamaModel

LOGIT_STD = 4.0


def _randn(shape, std: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std


@torch.inference_mode()
def init_random(model: LlamaModel, seed: int = 0) -> None:
    """Fill `model` with seeded random weights, generated on the model's device (so a 70B FP8
    model initialises on a GPU in seconds, one layer of fp32 scratch at a time)."""
    cfg = model.cfg
    device = model.embed_tokens.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    h = cfg.hidden_size
    model.embed_tokens.copy_(_randn(model.embed_tokens.shape, 1.0, gen, device))
    for i in range(cfg.num_layers):
        attn, mlp = model.layer(i).self_attn, model.layer(i).mlp
        attn.qkv_proj.load(_randn((cfg.q_size + 2 * cfg.kv_size, h), h**-0.5, gen, device))
        attn.o_proj.load(_randn((h, cfg.q_size), cfg.q_size**-0.5 / 2, gen, device))
        mlp.gate_up_proj.load(_randn((2 * cfg.intermediate_size, h), h**-0.5, gen, device))
        mlp.down_proj.load(_randn((h, cfg.intermediate_size), cfg.intermediate_size**-0.5 / 2, gen, device))
    if model.lm_head is not None:
        model.lm_head.copy_(_randn(model.lm_head.shape, LOGIT_STD * h**-0.5, gen, device))


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight$")


def _safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open  # noqa: PLC0415

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _gguf(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from engine.gguf_file import GGUFFile  # noqa: PLC0415

    for name, w in GGUFFile(path).tensors():
        yield name, torch.from_numpy(w.copy() if not w.flags.writeable else w)


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) from a checkpoint: a directory of `*.safetensors`, a directory
    holding one `*.gguf` (what `pdserve model pull` writes), or a `.gguf` file."""
    path = Path(path)
    if path.is_file():
        return _gguf(path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        return _safetensors(files)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf(ggufs[0])
    if ggufs:
        raise ValueError(f"{path}: several *.gguf files ({', '.join(g.name for g in ggufs)}); pass one as --model")
    raise FileNotFoundError(f"no *.safetensors or *.gguf files in {path}")


@torch.inference_mode()
def load_hf_checkpoint(model: LlamaModel, directory: str | Path) -> None:
    """Load a Hugging Face LlamaForCausalLM checkpoint (safetensors, or GGUF dequantized) into
    `model`, fusing q/k/v and gate/up and quantizing every projection as the model's linears
    require."""
    directory = Path(directory)
    pending: dict[int, dict[str, torch.Tensor]] = {}
    seen: set[str] = set()
    for name, t in checkpoint_tensors(directory):
        seen.add(name)
        if name == "model.embed_tokens.weight":
            model.embed_tokens.copy_(t.to(model.embed_tokens.dtype))
        elif name == "model.norm.weight":
            model.norm.weight.copy_(t.float())
        elif name == "lm_head.weight":
            if model.lm_head is not None:
                model.lm_head.copy_(t.to(model.lm_head.dtype))
        elif m := _LAYER_RE.match(name):
            pending.setdefault(int(m.group(1)), {})[m.group(2)] = t
            _flush_layer(model, int(m.group(1)), pending)
    if "model.embed_tokens.weight" not in seen:
        raise ValueError(f"{directory}: checkpoint has no model.embed_tokens.weight (not a Llama checkpoint?)")
    if model.lm_head is not None and "lm_head.weight" not in seen:
        raise ValueError(f"{directory}: config has untied embeddings but the checkpoint has no lm_head.weight")
    missing = sorted(i for i in pending if pending[i])
    if missing:
        raise ValueError(f"{directory}: incomplete weights for layers {missing[:8]}")
    if len(pending) != model.cfg.num_layers:
        raise ValueError(f"{directory}: found {len(pending)} layers, config says {model.cfg.num_layers}")


_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def _flush_layer(model: LlamaModel, i: int, pending: dict[int, dict[str, torch.Tensor]]) -> None:
    """Once all nine tensors of layer i have arrived, fuse, quantize and drop them."""
    p = pending[i]
    if not all(k in p for k in _PARTS):
        return
    dev = model.embed_tokens.device
    layer = model.layer(i)
    qkv = torch.cat([p["self_attn.q_proj"], p["self_attn.k_proj"], p["self_attn.v_proj"]]).to(dev, torch.float32)
    layer.self_attn.qkv_proj.load(qkv)
    layer.self_attn.o_proj.load(p["self_attn.o_proj"].to(dev, torch.float32))
    layer.mlp.gate_up_proj.load(torch.cat([p["mlp.gate_proj"], p["mlp.up_proj"]]).to(dev, torch.float32))
    layer.mlp.down_proj.load(p["mlp.down_proj"].to(dev, torch.float32))
    layer.input_layernorm.weight.copy_(p["input_layernorm"].float())
    layer.post_attention_layernorm.weight.copy_(p["post_attention_layernorm"].float())
    pending[i] = {}


def build_model(
    cfg: ModelConfig,
    weight_dtype: str = "fp8",
    device: str | torch.device = "cpu",
    checkpoint_dir: str | Path | None = None,
    seed: int = 0,
) -> LlamaModel:
    """The model with real (checkpoint) or seeded random weights. Activations are fp32 on CPU
    (bf16 matmuls crawl there) and bf16 on CUDA."""
    device = torch.device(device)
    act_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if weight_dtype == "fp32":
        act_dtype = torch.float32
    model = LlamaModel(cfg, weight_dtype, act_dtype, device)
    if checkpoint_dir is not None:
        load_hf_checkpoint(model, checkpoint_dir)
    else:
        init_random(model, seed)
    return model.eval()
