"""Read a Llama-architecture GGUF file: its config, tokenizer, chat template and weights.

GGUF (llama.cpp's format) stores a model as metadata key/values plus tensors in block-quantized
types. pdserve reads it with the `gguf` package (from llama.cpp) and turns it into what a Hugging
Face checkpoint directory would hold:

- `hf_config()`: the `config.json` dictionary (so `ModelConfig.from_hf_config` applies unchanged);
- `tokenizer_json()`: a `tokenizers` BPE tokenizer rebuilt from the vocab, merges and specials;
- `tensors()`: every weight dequantized to float32 under its Hugging Face name, with the Q/K rows
  put back in Hugging Face order (llama.cpp's converter interleaves the two rotary halves of every
  head; pdserve's rotary embedding, like transformers', expects them split).

Nothing here imports torch: weights come out as numpy arrays; engine/checkpoint/weights.py quantizes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

# The tensor types the issue asks for (anything else is refused by name, not mis-read).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# GGUF tensor name (within a block) -> Hugging Face LlamaForCausalLM name
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's pre-tokenizer names whose regex splits every digit first (\p{N}) before GPT-2's
# regex: in `tokenizers` terms, Digits(individual_digits=True) then ByteLevel.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
# The GPT-2 regex family (no digit split first) that a plain ByteLevel pre-tokenizer reproduces.
_GPT2_PRE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}


class GGUFError(ValueError):
    """A GGUF file pdserve cannot load; the message is one line naming the file and the reason."""


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix.lower() == ".gguf"


class GGUFFile:
    def __init__(self, path: str | Path):
        import gguf  # noqa: PLC0415 - only GGUF users pay for it

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - truncated/garbage files fail in many ways inside the reader
            raise GGUFError(
                f"{self.path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
            ) from None
        self._fields = self._reader.fields
        arch = self.get("general.architecture")
        if arch != "llama":
            raise GGUFError(f"{self.path}: architecture {arch!r}; pdserve loads Llama-architecture GGUF files only")
        self._check_size()

    # ---- metadata ------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        f = self._fields.get(key)
        return default if f is None else f.contents()

    def _need(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return v

    def _check_size(self) -> None:
        """GGUFReader memory-maps the file and may not notice a short last tensor: check it."""
        end = max((t.data_offset + t.n_bytes for t in self._reader.tensors), default=0)
        size = self.path.stat().st_size
        if end > size:
            raise GGUFError(f"{self.path}: truncated ({size} bytes; its tensors need {end})")

    def hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face Llama config.json."""
        a = "llama."
        scaling = self.get(a + "rope.scaling.type")
        if scaling not in (None, "none"):
            raise GGUFError(f"{self.path}: rope scaling {scaling!r} is not supported")
        heads = int(self._need(a + "attention.head_count"))
        hidden = int(self._need(a + "embedding_length"))
        vocab = self.get(a + "vocab_size") or len(self._need("tokenizer.ggml.tokens"))
        names = {t.name for t in self._reader.tensors}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._need(a + "feed_forward_length")),
            "num_hidden_layers": int(self._need(a + "block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.get(a + "attention.head_count_kv") or heads),
            "head_dim": int(self.get(a + "rope.dimension_count") or hidden // heads),
            "max_position_embeddings": int(self.get(a + "context_length") or 2048),
            "rope_theta": float(self.get(a + "rope.freq_base") or 10000.0),
            "rms_norm_eps": float(self.get(a + "attention.layer_norm_rms_epsilon") or 1e-5),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.get("tokenizer.ggml.eos_token_id"),
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }

    @property
    def chat_template(self) -> str | None:
        return self.get("tokenizer.chat_template")

    @property
    def add_bos(self) -> bool:
        return bool(self.get("tokenizer.ggml.add_bos_token", True))

    def special_tokens(self) -> dict[int, str]:
        """Control tokens (GGUF token type 3): never split, skipped when decoding."""
        tokens, types = self._need("tokenizer.ggml.tokens"), self.get("tokenizer.ggml.token_type") or []
        return {i: tokens[i] for i, t in enumerate(types) if t == 3}

    def tokenizer_json(self) -> str:
        """A Hugging Face `tokenizer.json` equivalent to the file's GPT-2-style BPE tokenizer."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

        kind = self.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{self.path}: tokenizer model {kind!r}; pdserve reads GPT-2-style BPE ('gpt2') only")
        pre = self.get("tokenizer.ggml.pre", "default")
        if pre not in _DIGIT_SPLIT_PRE | _GPT2_PRE:
            raise GGUFError(f"{self.path}: pre-tokenizer {pre!r} is not supported")
        tokens = self._need("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self._need("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if pre in _DIGIT_SPLIT_PRE
            else byte_level
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for _, t in sorted(self.special_tokens().items())]
        )
        return tok.to_str()

    def tokenizer_config(self) -> dict[str, Any]:
        """The parts of `tokenizer_config.json` pdserve reads: bos/eos, add_bos_token, chat_template."""
        tokens = self._need("tokenizer.ggml.tokens")

        def name(key: str) -> str | None:
            i = self.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return {
            "bos_token": name("tokenizer.ggml.bos_token_id"),
            "eos_token": name("tokenizer.ggml.eos_token_id"),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }

    # ---- weights -------------------------------------------------------------------------------
    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, float32 array [out, in]) for every weight, in file order."""
        from gguf.quants import dequantize  # noqa: PLC0415

        cfg = self.hf_config()
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for t in self._reader.tensors:
            kind = t.tensor_type.name
            hf = _hf_name(t.name)
            if hf is None:
                if t.name == "rope_freqs.weight":
                    raise GGUFError(f"{self.path}: has rope_freqs (Llama 3 rope scaling), which is not supported")
                continue
            if kind not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {t.name} has type {kind}; supported: {', '.join(SUPPORTED_TYPES)}"
                )
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if hf.endswith("q_proj.weight"):
                w = unpermute_rows(w, heads)
            elif hf.endswith("k_proj.weight"):
                w = unpermute_rows(w, kv_heads)
            yield hf, w


def _hf_name(name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")  # "blk.3.attn_q", "weight"
    if suffix != "weight":
        return None
    if stem in _TOP_NAMES:
        return _TOP_NAMES[stem] + ".weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation. Its converter reorders each head's rows from
    [first rotary half, second half] (Hugging Face, rotate_half) to interleaved pairs (GGML's
    rope): w.reshape(n, 2, d/2, in).swapaxes(1, 2). This is the inverse."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf_metadata(g: GGUFFile, directory: Path) -> None:
    """config.json, generation_config.json, tokenizer.json and tokenizer_config.json of `g`
    into `directory` (the weights stay in the GGUF file beside them)."""
    cfg = g.hf_config()
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (directory / "tokenizer.json").write_text(g.tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps(g.tokenizer_config(), indent=2) + "\n")
    if g.chat_template:  # where transformers >= 4.47 looks for it
        (directory / "chat_template.jinja").write_text(g.chat_template)


__all__ = ["GGUFError", "GGUFFile", "SUPPORTED_TYPES", "is_gguf", "unpermute_rows", "write_hf_metadata"]
