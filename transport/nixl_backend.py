"""NixlTransport: the KV pool shipped between processes by a NIXL agent over UCX.

One agent per worker, one registered region (the whole pool: host memory on CPU, GPU memory on
CUDA). A decode worker pulls (READ) a prompt's blocks from the prefill worker's pool, as few
coalesced descriptors as the block ids allow, then notifies the prefill side that it may free them.

Settings, measured on a 2-core CPU host with two processes moving 256 MB host-to-host
(`pdserve bench transfer`, and the sweeps recorded in the issue-4 report):

- UCX already picks its zero-copy `cma` (process_vm_readv) protocol for host READs between
  processes on one machine. The UCX knobs tried (UCX_TLS=self,cma,tcp, UCX_MAX_RMA_RAILS=1,
  UCX_RMA_ZCOPY_MAX_SEG_SIZE=1g) changed neither throughput nor start-up, so pdserve sets no UCX
  environment variables; a user's own UCX_* settings pass through untouched.
- NIXL's progress thread is what costs: the Python wrapper starts it busy-polling (a full core
  while idle, half the machine here) and a puller that has it moves ~2.5 GB/s instead of ~5.
  So: `progress_thread=False` on a pure puller (the copy runs on the calling threads), and where
  a thread is needed (a pool others read: it must answer connection handshakes and receive
  notifications while its owner is busy) it sleeps `PROGRESS_DELAY_US` between polls.
- One copy thread is capped near single-core memcpy. `streams` UCX workers, each fed by its own
  thread with a byte-balanced share of the descriptors (NIXL releases the GIL while posting),
  reach ~8-9 GB/s on 2 cores; the agent runs in RW thread-sync mode so those threads are safe.
  GPU pools use one stream: the copy engine, not a CPU thread, moves the bytes there.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from transport.base import TransferTimeout, Transport, TransportError
from transport.coalesce import Run, split_for_streams
from transport.wire import KVHandle, KVLayout, PeerInfo, TransferStats

PROGRESS_DELAY_US = 100  # progress-thread sleep between idle polls: ~3% of a core instead of 100%
# A layer-wise pull runs while the prefill it waits for still computes, on the same cores: after
# SPIN_S of spinning on its completion it sleeps YIELD_S between checks. Spinning through every
# pull of a slow link took a core from the prefill (TTFT +22% at 10 Mbit/s on the 2-core
# rehearsal). A bulk pull runs after the prefill and keeps spinning: nothing to yield to.
SPIN_S = 0.001
YIELD_S = 0.0001
_AGENT_LOCK = threading.Lock()  # guards the temporary agent-config hook below


def _nixl():
    try:
        # private-ok: NIXL's Python API lives in nixl._api (its own examples import it from there)
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # noqa: PLC0415 - a clear error if absent
    except ImportError as e:  # pragma: no cover - nixl is a dependency
        raise TransportError(f"NIXL is not importable ({e}); install the nixl package") from e
    _nixl_logs_to_stderr()
    return nixl_agent, nixl_agent_config, nixl_thread_sync_t


def _nixl_logs_to_stderr() -> None:
    """NIXL's Python package logs INFO lines ("Initialized NIXL agent", ...) to stdout; stdout is
    for results (tables, `--json` documents), so its handlers write to stderr instead."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _create_agent(name: str, progress_thread: bool, workers: int):
    """A NIXL agent with the UCX backend. The Python wrapper hard-codes the progress thread's
    poll delay to 0 (busy spin); the native config has the field, so it is set on its way in."""
    nixl_agent, nixl_agent_config, sync = _nixl()
    cfg = nixl_agent_config(enable_prog_thread=progress_thread, backends=[], sync_mode=sync.NIXL_THREAD_SYNC_RW)
    bind = sys.modules[nixl_agent.__module__].nixlBind
    real = bind.nixlAgent

    def with_delay(agent_name, native_cfg):
        native_cfg.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, native_cfg)

    with _AGENT_LOCK:
        bind.nixlAgent = with_delay
        try:
            agent = nixl_agent(name, cfg)
        finally:
            bind.nixlAgent = real
    if "UCX" not in agent.get_plugin_list():
        raise TransportError("the NIXL UCX plugin is not available")
    agent.create_backend("UCX", {"num_workers": str(workers)})
    return agent


class NixlTransport(Transport):
    backend = "nixl"

    def __init__(self, agent: str, progress_thread: bool = True, streams: int | None = None):
        """`progress_thread`: keep one for a pool that peers read (prefill); a pure puller
        (decode worker, benchmark) is faster without. `streams`: parallel copy threads for host
        pools (default: min(2, cores)); device pools always use one."""
        super().__init__(agent)
        self.progress_thread = progress_thread
        self.streams = max(1, streams if streams is not None else min(2, os.cpu_count() or 1))
        self._agent = _create_agent(agent, progress_thread, self.streams)
        self._pool: torch.Tensor | None = None
        self._reg = None
        self._mem_type = "DRAM"
        self._peers: dict[str, PeerInfo] = {}
        self._pending_notifs: list[str] = []
        self._executor: ThreadPoolExecutor | None = None
        self.final_metadata: bytes | None = None  # the agent's metadata after close() deregistered

    # ---- setup --------------------------------------------------------------------------------
    def register(self, pool: torch.Tensor, layout: KVLayout) -> None:
        self._check_open()
        if self._pool is not None:
            raise TransportError(f"agent {self.agent!r} already registered a pool")
        self._check_pool(pool, layout)
        self._mem_type = "VRAM" if pool.is_cuda else "DRAM"
        self._reg = self._agent.register_memory(pool)
        self._pool, self.layout = pool, layout
        if self._mem_type == "VRAM":
            self.streams = 1

    def _metadata(self) -> bytes:
        """The agent's NIXL metadata: what a peer loads to reach it as a remote agent."""
        return self._agent.get_agent_metadata()

    def connect(self, peer: PeerInfo) -> None:
        self._check_open()
        if peer.backend != self.backend:
            raise TransportError(f"peer {peer.agent!r} speaks {peer.backend!r}, this agent speaks 'nixl'")
        self.check_layout(peer)
        known = self._peers.get(peer.agent)
        if known is not None and known.metadata == peer.metadata:
            return
        if known is not None:  # the peer restarted: forget its old endpoint and memory
            self._agent.remove_remote_agent(peer.agent)
            del self._peers[peer.agent]
        try:
            name = self._agent.add_remote_agent(peer.metadata)
            name = name.decode() if isinstance(name, bytes) else name
        except Exception as e:
            raise TransportError(f"cannot load metadata of peer {peer.agent!r}: {e}") from e
        if name != peer.agent:
            self._agent.remove_remote_agent(name)
            raise TransportError(f"peer metadata names agent {name!r}, PeerInfo says {peer.agent!r}")
        whole = [(peer.base_addr, peer.layout.pool_bytes, peer.device_id)]
        if not self._agent.check_remote_metadata(name, self._agent.get_xfer_descs(whole, peer.mem_type)):
            self._agent.remove_remote_agent(name)
            raise TransportError(
                f"peer {peer.agent!r} does not expose its KV pool "
                f"({peer.layout.pool_bytes} bytes at {peer.base_addr:#x}); closed?"
            )
        self._peers[peer.agent] = peer

    # ---- transfer -----------------------------------------------------------------------------
    def read(
        self, handle: KVHandle, local_blocks: list[int], timeout_s: float = 30.0, coalesced: bool = True
    ) -> TransferStats:
        """Pull the handle's blocks into `local_blocks`. `coalesced=False` posts one descriptor
        per block (benchmark baseline only)."""
        self._check_read(handle)
        self.connect(handle.source)
        peer = self._peers[handle.agent]
        runs = self.handle_runs(handle, local_blocks, peer.layout.num_blocks, coalesced)
        groups = split_for_streams(runs, self.streams)
        deadline = time.perf_counter() + timeout_s
        t0 = time.perf_counter()
        yielding = handle.layers is not None
        if len(groups) == 1:
            self._read_group(peer, groups[0], deadline, handle.request_id, yielding)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.streams, thread_name_prefix=f"nixl-{self.agent}")
            futures = [
                self._executor.submit(self._read_group, peer, g, deadline, handle.request_id, yielding) for g in groups
            ]
            errors = [f.exception() for f in futures]  # waits for all: no handle outlives read()
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        seconds = time.perf_counter() - t0
        verify_s = self._verify_read(handle, local_blocks)
        nbytes = self.moved_bytes(handle, len(local_blocks))
        stats = TransferStats.build(handle.request_id, self.backend, nbytes, sum(len(g) for g in groups), seconds)
        stats.verify_s = verify_s
        return stats

    def _read_group(
        self, peer: PeerInfo, runs: list[Run], deadline: float, request_id: str, yielding: bool = False
    ) -> None:
        assert self._pool is not None  # only called by read(), after _check_read
        base = self._pool.data_ptr()
        dev = max(self._pool.get_device(), 0)
        local = np.array([(base + r.local_offset, r.nbytes, dev) for r in runs], dtype=np.uint64)
        remote = np.array([(peer.base_addr + r.remote_offset, r.nbytes, peer.device_id) for r in runs], dtype=np.uint64)
        try:
            xfer = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, self._mem_type),
                self._agent.get_xfer_descs(remote, peer.mem_type),
                peer.agent,
            )
            state = self._agent.transfer(xfer)
        except Exception as e:
            raise TransportError(
                f"request {request_id!r}: cannot start a READ from {peer.agent!r} (peer dead or unreachable?): {e}"
            ) from e
        try:
            spin_until = time.perf_counter() + SPIN_S
            while state == "PROC":
                if yielding and time.perf_counter() > spin_until:
                    time.sleep(YIELD_S)
                if time.perf_counter() > deadline:
                    raise TransferTimeout(
                        f"request {request_id!r}: READ from {peer.agent!r} not done "
                        f"within its timeout; transfer released"
                    )
                try:
                    state = self._agent.check_xfer_state(xfer)
                except Exception as e:  # NIXL raises its bare code (NIXL_ERR_REMOTE_DISCONNECT): name the peer
                    raise TransportError(
                        f"request {request_id!r}: READ from {peer.agent!r} (peer dead or unreachable?) "
                        f"failed in flight: {e}"
                    ) from e
            if state != "DONE":
                raise TransportError(
                    f"request {request_id!r}: READ from {peer.agent!r} failed (state {state}): peer dead or unreachable"
                )
        finally:
            try:
                xfer.release()  # cancels an in-flight transfer (timeout) before the handle goes
            except Exception:  # a transfer that cannot be cancelled stays on NIXL's leak list
                pass

    # ---- notifications ------------------------------------------------------------------------
    def _send(self, peer_agent: str, message: bytes) -> None:
        self._check_open()
        if peer_agent not in self._peers:
            raise TransportError(f"notify: unknown peer {peer_agent!r} (connect first)")
        try:
            self._agent.send_notif(peer_agent, message)
        except Exception as e:
            raise TransportError(f"notify {peer_agent!r} failed: {e}") from e

    def _receive(self) -> list[bytes]:
        self._check_open()
        out: list[bytes] = []
        for msgs in self._agent.get_new_notifs().values():
            out += [m if isinstance(m, bytes) else str(m).encode() for m in msgs]
        return out

    # ---- teardown -----------------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        return self._reg is not None

    def close(self) -> None:
        if self._agent is None:
            return
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for name in list(self._peers):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass  # a peer that is already gone has nothing left to disconnect
        self._peers.clear()
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg, self._pool = None, None
        self.final_metadata = self._agent.get_agent_metadata()
        self._agent = None

    def _check_open(self) -> None:
        if self._agent is None:
            raise TransportError(f"transport {self.agent!r} is closed")
