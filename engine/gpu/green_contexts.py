"""Single-GPU disaggregation: prefill and decode engines in one process, on disjoint SM sets.

A CUDA green context owns a subset of the GPU's SMs; kernels launched on its stream run only on
those SMs. Giving the decode engine one partition and the prefill engine the other removes the
article's interference on a single card: a long prefill can no longer occupy the SMs a decode
step needs (memory bandwidth is still shared, which is what the benchmark measures).

    part = SmPartition.create(decode_sms=48)                  # the rest goes to prefill
    disagg = SingleGpuDisagg(prefill_engine, decode_engine, part)   # part=None: plain streams
    disagg.start(); disagg.submit(seq); ...; disagg.stop()

Both engines share the model weights (read-only; see `share_model`) and own separate KV pools.
A prefilled sequence's blocks are copied pool to pool on the decode stream (device memory to
device memory, the single-card stand-in for the transport), then the prefill side releases them.
Each engine is driven by its own thread, so each `.cpu()` of its logits waits only for its own
stream. torch's current stream is per thread, which is what keeps the two apart.

The torch API changed between releases (create(num_sms, device_id) -> keyword arguments;
make_current/pop_current -> set_context/pop_context; Stream() added later); `_green_stream`
copes with each and says which it used.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import CacheConfig
from engine.core.llm_engine import LLMEngine, TokenEvent
from engine.kv.cache import KVCache
from engine.kv.layout import KVLayout
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import Sampler
from engine.sequence import Sequence


def green_contexts_supported() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from torch.cuda import green_contexts  # noqa: PLC0415
    except ImportError:
        return False
    return bool(getattr(green_contexts, "SUPPORTED", False))


def _green_stream(num_sms: int, device: int) -> tuple[object, torch.cuda.Stream, str]:
    """A green context with `num_sms` SMs and a torch stream whose kernels run on them."""
    from torch.cuda.green_contexts import GreenContext  # noqa: PLC0415

    # Any: this code spans torch versions whose GreenContext API differs (checked at run time below)
    green: Any = GreenContext
    try:
        ctx = green.create(num_sms=num_sms, device_id=device)
    except TypeError:  # older positional signature
        ctx = green.create(num_sms, device)
    if hasattr(ctx, "Stream"):
        return ctx, ctx.Stream(), "GreenContext.Stream()"
    # No Stream(): create a stream while the green context is current, so it belongs to it.
    enter = getattr(ctx, "set_context", None) or ctx.make_current
    leave = getattr(ctx, "pop_context", None) or ctx.pop_current
    enter()
    try:
        s = torch.cuda.Stream(device=device)
    finally:
        leave()
    return ctx, s, "stream created under set_context (unverified path)"


def _driver_split(decode_sms: int, device: int) -> tuple[list, torch.cuda.Stream, torch.cuda.Stream, int, str]:
    """Disjoint by construction: ONE driver split of the device's SMs into a decode group and the
    remainder, a green context on each, and a stream in each (cuda-python's driver bindings).
    Two separate `GreenContext.create` calls are not guaranteed disjoint: each splits the whole
    device and may hand out the same first SMs."""
    from cuda.bindings import driver as cu  # noqa: PLC0415

    def ok(res):
        if res[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {res[0]}")
        return res[1:] if len(res) > 2 else res[1]

    torch.cuda.init()
    dev = ok(cu.cuDeviceGet(device))
    sm = ok(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = ok(cu.cuDevSmResourceSplitByCount(1, sm, 0, decode_sms))
    made, streams = [], []
    for res in (rest, groups[0]):  # prefill: the remainder; decode: the group
        desc = ok(cu.cuDevResourceGenerateDesc([res], 1))
        ctx = ok(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        raw = ok(cu.cuGreenCtxStreamCreate(ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        made.append((ctx, raw))
        streams.append(torch.cuda.ExternalStream(int(raw), device=device))
    got = int(groups[0].sm.smCount)
    return made, streams[0], streams[1], got, "cuda.bindings driver split (disjoint)"


@dataclass
class SmPartition:
    """Two streams on disjoint SM sets (or, with `partitioned=False`, two ordinary streams on
    the whole GPU: the time-shared comparison)."""

    prefill_stream: torch.cuda.Stream
    decode_stream: torch.cuda.Stream
    prefill_sms: int
    decode_sms: int
    total_sms: int
    partitioned: bool
    how: str
    _contexts: list = field(default_factory=list, repr=False)  # keep the contexts alive

    @classmethod
    def create(cls, decode_sms: int, prefill_sms: int | None = None, device: int = 0) -> SmPartition:
        if not green_contexts_supported():
            raise RuntimeError(
                "CUDA green contexts need a CUDA build of torch with green-context support "
                "(torch.cuda.green_contexts.SUPPORTED) and a driver >= 12.8"
            )
        total = torch.cuda.get_device_properties(device).multi_processor_count
        prefill_sms = total - decode_sms if prefill_sms is None else prefill_sms
        if decode_sms < 1 or prefill_sms < 1 or decode_sms + prefill_sms > total:
            raise ValueError(f"SM split {prefill_sms} prefill + {decode_sms} decode does not fit {total} SMs")
        if prefill_sms == total - decode_sms:
            try:
                made, ps, ds, got, how = _driver_split(decode_sms, device)
                return cls(ps, ds, total - got, got, total, True, how, made)
            except Exception as e:  # noqa: BLE001 (no cuda-python, or another driver API: use torch's)
                fallback = f"; driver split unavailable ({type(e).__name__}: {e})"
        else:
            fallback = ""
        pc, ps, how = _green_stream(prefill_sms, device)
        dc, ds, _ = _green_stream(decode_sms, device)
        how += " x2, each split from the whole device: the two SM sets may overlap" + fallback
        return cls(ps, ds, prefill_sms, decode_sms, total, True, how, [pc, dc])

    @classmethod
    def shared(cls, device: int = 0) -> SmPartition:
        total = torch.cuda.get_device_properties(device).multi_processor_count
        return cls(torch.cuda.Stream(device), torch.cuda.Stream(device), total, total, total, False, "two streams")


def share_model(runner: ModelRunner, cache_cfg: CacheConfig) -> ModelRunner:
    """A second runner on the same weights with its own KV pool (no second copy of the model)."""
    twin = copy.copy(runner)
    twin.cache_cfg = cache_cfg
    twin.layout = KVLayout.build(runner.model_cfg, cache_cfg)
    twin.cache = KVCache(twin.layout, runner.device)
    twin.graphs = None  # graphs captured on the first runner read its pool, not this one
    twin.sampler = Sampler(runner.device)  # its own generator: the twins sample from two threads
    return twin


class SingleGpuDisagg:
    """Drives a prefill-only engine and a decode engine side by side, each in its own thread
    and stream. `on_token` receives every TokenEvent (from either thread)."""

    def __init__(
        self,
        prefill: LLMEngine,
        decode: LLMEngine,
        partition: SmPartition | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
    ):
        if not prefill.prefill_only:
            raise ValueError("the prefill engine must be built with prefill_only=True")
        if prefill.runner.layout.compat_hash != decode.runner.layout.compat_hash:
            raise ValueError(
                "prefill and decode pools have different KV layouts: "
                + "; ".join(prefill.runner.layout.differences(decode.runner.layout))
            )
        self.prefill, self.decode = prefill, decode
        self.partition = partition or SmPartition.shared()
        self.on_token = on_token or (lambda e: None)
        self._incoming: queue.Queue[Sequence] = queue.Queue()
        self._handoff: queue.Queue[tuple[Sequence, torch.cuda.Event]] = queue.Queue()
        self._released: queue.Queue[str] = queue.Queue()
        self._waiting_blocks: list[tuple[Sequence, torch.cuda.Event]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def submit(self, seq: Sequence) -> None:
        self.prefill.check_fits(len(seq.prompt_ids), seq.params.max_tokens)
        self.decode.check_fits(len(seq.prompt_ids), seq.params.max_tokens)
        self._incoming.put(seq)

    def start(self) -> None:
        for fn in (self._prefill_loop, self._decode_loop):
            t = threading.Thread(target=self._guard, args=(fn,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        if self.errors:
            raise RuntimeError("a single-GPU disaggregation thread failed") from self.errors[0]

    @property
    def idle(self) -> bool:
        return (
            self._incoming.empty()
            and self._handoff.empty()
            and not self._waiting_blocks
            and not self.prefill.has_work
            and not self.decode.has_work
        )

    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced by stop()
            self.errors.append(e)
            self._stop.set()

    def _prefill_loop(self) -> None:
        with torch.cuda.stream(self.partition.prefill_stream):
            while not self._stop.is_set():
                while not self._incoming.empty():
                    self.prefill.add_request(self._incoming.get())
                while not self._released.empty():
                    self.prefill.release(self._released.get())
                if not self.prefill.has_work:
                    self._stop.wait(0.0005)
                    continue
                for ev in self.prefill.step():
                    seq = self.prefill.parked[ev.seq_id]
                    done = torch.cuda.Event()
                    done.record()  # the pages are complete once the prefill stream gets here
                    self.on_token(ev)  # before the handoff: the first token precedes the decode's
                    self._handoff.put((seq, done))

    def _decode_loop(self) -> None:
        with torch.cuda.stream(self.partition.decode_stream):
            while not self._stop.is_set():
                while not self._handoff.empty():
                    self._waiting_blocks.append(self._handoff.get())
                self._admit()
                if not self.decode.has_work:
                    self._stop.wait(0.0005)
                    continue
                for ev in self.decode.step():
                    if ev.index > 0:  # index 0 was the prefill's token
                        self.on_token(ev)

    def _admit(self) -> None:
        """Copy handed-off sequences into the decode pool (FIFO; the head waits for blocks)."""
        while self._waiting_blocks:
            src, done = self._waiting_blocks[0]
            if not self.decode.blocks.can_allocate(
                self.decode.blocks.blocks_for(len(src.prompt_ids) + src.params.max_tokens)
            ):
                return
            self._waiting_blocks.pop(0)
            blocks = self.decode.reserve(len(src.prompt_ids), src.params.max_tokens)
            n = self.decode.blocks.blocks_for(len(src.prompt_ids))
            torch.cuda.current_stream().wait_event(done)
            dev = self.decode.runner.device
            dst_idx = torch.tensor(blocks[:n], dtype=torch.long, device=dev)
            src_idx = torch.tensor(src.block_table[:n], dtype=torch.long, device=dev)
            self.decode.runner.cache.raw[dst_idx] = self.prefill.runner.cache.raw[src_idx]
            torch.cuda.current_stream().synchronize()  # the prefill side may reuse its blocks now
            self._released.put(src.seq_id)
            seq = Sequence(
                src.seq_id, list(src.prompt_ids), src.params, output_ids=list(src.output_ids), block_table=blocks
            )
            self.decode.add_prefilled(seq)
            if seq.finish_reason is not None:  # finished on its first token
                self.on_token(TokenEvent(seq.seq_id, seq.output_ids[-1], 0, True, seq.finish_reason))
