"""The CPU decode step compiled by torch.compile (inductor's C++ backend), behind `--compile`.

What a decode step on CPU pays besides its arithmetic is dispatch: about a thousand small eager
ops a step (norms, RoPE, splits, casts) and 150 module calls, each a Python call and a kernel
launch. Compiled, the ops between two GEMMs become one or two generated C++ loops, and the Python
between them is gone.

What the compiler sees, and what it does not:
- The projections are pdserve's FP8 few-row GEMM (`torch.ops.pdserve.fp8_linear`, a C++ op with
  a shape function registered here): the compiled code calls it directly, with no Python between
  the ops. So the step is compiled for the batches that kernel runs (up to
  `FP8_KERNEL_MAX_ROWS` rows); larger decode batches run eagerly.
- The lm_head (fp32, oneDNN or the one-row GEMV) is one opaque Python op, `pdserve::project`,
  whose handle names the model's bound GEMM in this process's registry (`_PROJECTIONS`).
- The paged FP8 attention is the C++ kernel (engine/model/csrc/) behind `pdserve::decode_attention`,
  which also writes the step's K/V into the pool. That write is a side effect the graph does not
  see: the pool is not an input, only the op's output is, so the op runs exactly once, in layer
  order (each layer's output feeds the next); a pool as a graph input would be functionalized,
  at the risk of a copy of the whole pool per step.

This is the `DecodeGraphs` seam of `ModelRunner` (the CUDA graphs' one): decode-only steps call
`replay_step`; prefill and mixed steps stay eager. Shapes: the batch and the block table's
width are dynamic; torch specializes a size of 1, so batch 1 is its own graph and the table is
padded to at least 2 columns. Two graphs then cover every decode step (`compiles` counts them,
and a log line says each). Both are compiled in `warm_up`, before the worker reports ready.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine import torch_compat
from engine.kv.cache import KVCache, SlotIndex
from engine.model.cpu_kernels import fp8_linear_op, paged_decode_op
from engine.model.linear import FP8_KERNEL_MAX_ROWS, DenseLinear, Fp8Linear
from engine.model.llama import apply_rotary
from engine.runner.input_batch import DecodeInputs

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner

log = logging.getLogger("pdserve.engine")

COMPILE_MODES = ("off", "default", "max-autotune")  # and "auto" for serve (attach_compiled_decode)
MIN_WIDTH = 2  # block tables are padded to this many columns (a size of 1 would be its own graph)

# handle -> (the bound GEMM, its output features); handles are unique in the process, so several
# runners (tests build many) never call each other's layers. Handles are strings: a compile with
# dynamic shapes would trace an int read from an object as a symbolic size
_PROJECTIONS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], int]] = {}
# handle -> (the pool, its layer, the softmax scale) for decode_attention
_ATTENTION: dict[str, tuple[KVCache, int, float]] = {}
_handles = itertools.count(1)


@torch.library.custom_op("pdserve::project", mutates_args=())
def project(x: torch.Tensor, other: torch.Tensor | None, handle: str) -> torch.Tensor:
    """A layer's GEMM with its epilogue (none, add `other`, or SwiGLU), run eagerly by oneDNN."""
    fn, _ = _PROJECTIONS[handle]
    return fn(x, other)


@project.register_fake
def _(x: torch.Tensor, other: torch.Tensor | None, handle: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], _PROJECTIONS[handle][1])


@functools.cache
def _register_kernel_shapes() -> None:
    """Shape functions of the C++ FP8 GEMM, so the compiler can trace through it (once a process)."""
    if fp8_linear_op() is None:
        return

    @torch.library.register_fake("pdserve::fp8_linear")
    def _(x, w, scale, other, post):
        return x.new_empty(x.shape[0], w.shape[0] // 2 if post == 2 else w.shape[0])


@torch.library.custom_op("pdserve::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_blocks: torch.Tensor,
    kv_rows: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    handle: str,
) -> torch.Tensor:
    """One layer's decode attention: writes the step's K/V (kv [2B, Hkv, D], K rows then V rows)
    into the pool, then attends every row's q [B, Hq, D] over its pages (the C++ kernel)."""
    cache, layer, scale = _ATTENTION[handle]
    B = q.shape[0]
    cache.write_at(layer, SlotIndex(kv_blocks, kv_rows, 2 * cache.layout.block_size), kv[:B], kv[B:])
    kernel = paged_decode_op()
    assert kernel is not None and cache.scales is not None  # CompiledDecode.supported checked both
    return kernel(q, cache.data[:, layer].view(torch.uint8), cache.scales[:, layer], tables, lens, scale)


@decode_attention.register_fake
def _(q, kv, kv_blocks, kv_rows, tables, lens, handle):
    return torch.empty_like(q)


def _fp8(x: torch.Tensor, layer: Fp8Linear | DenseLinear, other: torch.Tensor | None, post: int) -> torch.Tensor:
    """A projection by the FP8 kernel (post 0 none, 1 add `other`, 2 SwiGLU), as Fp8Linear runs it
    (`unsupported_reason` checked that the model's layers are Fp8Linear)."""
    assert isinstance(layer, Fp8Linear)
    return torch.ops.pdserve.fp8_linear(x, layer.weight.view(torch.uint8), layer.weight_scale, other, post)


def unsupported_reason(runner: ModelRunner) -> str | None:
    """Why this runner's decode step cannot be compiled here (None: it can)."""
    if runner.device.type != "cpu":
        return "the compiled step is the CPU path (CUDA replays graphs)"
    if runner.model.act_dtype != torch.float32:
        return "the compiled step runs fp32 activations"
    if runner.cache.scales is None:
        return "the compiled step reads an FP8 KV cache"
    if paged_decode_op() is None or fp8_linear_op() is None:
        return "pdserve's C++ kernels are unavailable (engine/model/cpu_kernels.py)"
    if not isinstance(runner.model.layer(0).self_attn.qkv_proj, Fp8Linear) or runner.model.cpu_gemm != "fp32":
        return "the compiled step runs FP8 weights with fp32 GEMMs (--dtype fp8, --cpu-gemm fp32)"
    return None


class CompiledDecode:
    """Compiled decode steps for one runner (`runner.graphs`)."""

    def __init__(self, runner: ModelRunner, mode: str = "default"):
        if mode not in COMPILE_MODES[1:]:
            raise ValueError(f"compile mode must be one of {COMPILE_MODES[1:]}, got {mode!r}")
        why = unsupported_reason(runner)
        if why is not None:
            raise ValueError(f"cannot compile the decode step: {why}")
        self.runner, self.mode = runner, mode
        self.compiles = 0  # graphs compiled (a metric and a log line each)
        self.compile_s = 0.0
        model, cfg = runner.model, runner.model_cfg
        self._bs = runner.cache_cfg.block_size
        self._attention = [self._attend(runner.cache, i, model.layer(i).self_attn.scale) for i in range(cfg.num_layers)]
        self._head = self._project(lambda x, _o: model.compute_logits(x), cfg.vocab_size)
        _register_kernel_shapes()
        backend = torch_compat.counting_inductor(mode, self._compiled)
        self._step = torch.compile(self._forward, backend=backend, dynamic=True, fullgraph=True)

    @staticmethod
    def _project(fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], out_features: int) -> str:
        h = f"p{next(_handles)}"
        _PROJECTIONS[h] = (fn, out_features)
        return h

    @staticmethod
    def _attend(cache: KVCache, layer: int, scale: float) -> str:
        h = f"a{next(_handles)}"
        _ATTENTION[h] = (cache, layer, scale)
        return h

    def _compiled(self) -> None:
        self.compiles += 1
        log.info("compiled decode step: graph %d (mode %s)", self.compiles, self.mode)

    def close(self) -> None:
        """Forget this runner's handles (its layers and pool stay alive otherwise)."""
        for h in self._attention:
            _ATTENTION.pop(h, None)
        _PROJECTIONS.pop(self._head, None)

    # ---- the step ----------------------------------------------------------------------------
    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """The decode rows' forward, as LlamaModel.forward computes it: token ids [B] -> logits."""
        model, cfg = self.runner.model, self.runner.model_cfg
        B, D = input_ids.shape[0], cfg.head_dim
        rope = model.rotary.cos_sin(positions)
        blk, off = slots // self._bs, slots % self._bs
        kv_blocks, kv_rows = torch.cat([blk, blk]), torch.cat([off, off + self._bs])
        x = F.embedding(input_ids, model.embed_tokens)
        for i, attn_h in enumerate(self._attention):
            layer = model.layer(i)
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _fp8(layer.input_layernorm(x), attn.qkv_proj, None, 0)
            qk = apply_rotary(qkv[:, : cfg.q_size + cfg.kv_size].view(B, -1, D), *rope)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(B, cfg.num_kv_heads, D)
            o = decode_attention(
                q.contiguous(), torch.cat([k, v]), kv_blocks, kv_rows, block_tables, context_lens, attn_h
            )
            x = _fp8(o.reshape(B, cfg.q_size), attn.o_proj, x, 1)
            x = _fp8(_fp8(layer.post_attention_layernorm(x), mlp.gate_up_proj, None, 2), mlp.down_proj, x, 1)
        return project(model.norm(x), None, self._head)

    def fits(self, n: int, width: int) -> bool:
        return 1 <= n <= FP8_KERNEL_MAX_ROWS

    def replay_step(self, step: DecodeInputs) -> torch.Tensor:
        with torch.inference_mode():
            block_tables = step.block_tables
            if block_tables.shape[1] < MIN_WIDTH:
                block_tables = F.pad(block_tables, (0, MIN_WIDTH - block_tables.shape[1]))
            # every input a contiguous inference tensor: the compiled graph is guarded on both, and
            # the engine hands over either kind (its persistent batch's slices, ones made in the step)
            inputs = [
                t.contiguous() if t.is_inference() else t.clone(memory_format=torch.contiguous_format)
                for t in (step.input_ids, step.positions, step.slots, block_tables, step.context_lens.to(torch.int32))
            ]
            return self._step(*inputs)

    def warm_up(self) -> float:
        """Compile both graphs (batch 1, batch >= 2) on a step over the pool's first blocks, which
        are free at start (what is written there is overwritten by whoever is given them)."""
        t0 = time.perf_counter()
        n_blocks = min(self.runner.cache_cfg.num_blocks, 4)
        for rows in (1, 2):
            ids = torch.zeros(rows, dtype=torch.long)
            pos = torch.full((rows,), 3, dtype=torch.long)
            tables = torch.arange(n_blocks, dtype=torch.long).repeat(rows, 1)
            slots = tables[:, 0] * self._bs + 3
            self.replay_step(DecodeInputs(ids, pos, slots, tables, torch.full((rows,), 4, dtype=torch.int32)))
        self.compile_s = time.perf_counter() - t0
        return self.compile_s


def attach_compiled_decode(runner: ModelRunner, mode: str) -> CompiledDecode | None:
    """`--compile MODE` for a CPU runner: compiled graphs attached and compiled now (None for
    "off"). Raises ValueError where the step cannot be compiled (unsupported_reason).

    "auto" (serve's default for checkpoints; engine/worker_base.py) is "default" where the step
    compiles here; where it does not, or compiling fails, it runs eager and says why in the log."""
    if mode == "auto":
        why = unsupported_reason(runner)
        if why is not None:
            log.info("decode step eager (--compile auto: %s)", why)
            return None
        try:
            return attach_compiled_decode(runner, "default")
        except Exception as e:  # noqa: BLE001 - auto is best effort: the eager step is the same arithmetic
            log.warning("decode step eager (--compile auto: compiling failed: %s: %s)", type(e).__name__, e)
            runner.graphs = None
            return None
    if mode == "off":
        return None
    graphs = CompiledDecode(runner, mode)
    seconds = graphs.warm_up()
    runner.graphs = graphs
    log.info("decode step compiled (%s): %d graphs in %.1f s", mode, graphs.compiles, seconds)
    return graphs
