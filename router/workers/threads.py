"""How many intra-op torch threads each worker runs with (`--threads-per-worker`).

A worker owns some of its host's cores; its threads should match them. Ray reserves what an actor
asks for (`num_cpus`, and the same CPUs in its placement-group bundle) and, unless told
otherwise, sets OMP_NUM_THREADS to it, so before this every worker (`num_cpus=1`) ran on one core:
a colocated server on a 2-core machine decoded on one core while the other idled.

`auto` (the default) shares a host's cores evenly among the workers the server starts on it:
floor(cores / workers), at least one. The host's cores are:

- this machine's (`os.cpu_count()`) less one, left to the router (its HTTP and SSE work, Ray's
  own processes, a client on the same machine), when the workers run here: in this process, on
  the Ray cluster this server starts, or on one whose nodes all sit at this machine's address.
  Why one is left: OpenMP threads wait for each other at every parallel region, so when another
  process takes one of a step's cores the whole step waits. Measured on the 2-core dev VM
  (SmolLM2, colocated, 32 requests of 256 prompt tokens and 64 output tokens at concurrency 8,
  2026-12-03, servers one after another): two threads served 56.4, 39.4, 43.1 and 28.5 output
  tokens/s in four runs (decode step p50 93-198 ms), one thread 47.7 and 50.2 (94-99 ms). What a
  local cluster advertises is often fiction (the test suite's shared cluster says 8 CPUs on a
  2-core machine, so that any pool fits);
- otherwise the Ray cluster's own figure: the fewest CPUs a node with CPUs advertises, shared by
  the workers that land on each node if they spread evenly (ceil(workers / nodes)).

An OMP_NUM_THREADS in the server's environment is an explicit choice and wins over `auto` (the
test suite sets 1: tiny models on shared cores run far faster on one thread). An explicit
`--threads-per-worker N` wins over both.

Prompt steps (`--prompt-threads`, a step carrying at least 256 prompt tokens, engine/config.py
PROMPT_STEP_TOKENS says why 256) may take more: under
`auto`, a colocated server that prefills whole prompts gives its workers' prompt steps the core
left to the router too, because while such a step runs no token streams (every running sequence
waits for it) and the router has nothing to do. Its many-row GEMMs are long enough to pay for a
second thread (SmolLM2, 2,048 prompt tokens, in one process on the 2-core dev VM: 1,049 us a token
on 2 threads against 1,910 on 1), which decode steps, many short parallel regions a step, are not.
Chunked prefill streams tokens at every step and disaggregated prefill workers share the host with
decode workers, so there prompt steps keep the worker's count.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OMP_ENV = "OMP_NUM_THREADS"
ROUTER_CORES = 1  # cores `auto` leaves to the router on its own host (module docstring: why)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str  # one phrase for the start-up log
    router_cores: int = 0  # cores `auto` left to the router on this host (what prompt steps may borrow)


def auto_threads(cores: int, workers: int) -> int:
    """The auto rule: a host's cores shared evenly by the workers on it, at least one each."""
    return max(1, cores // max(1, workers))


def env_threads(env: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS as a positive integer, or None when unset or not one."""
    raw = env.get(OMP_ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def choose_threads(
    requested: int | None,
    workers: int,
    cores: int | None = None,
    nodes: Sequence[tuple[str, float]] | None = None,
    here: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> ThreadChoice:
    """Threads per worker for a server of `workers` workers. `requested`: --threads-per-worker
    (None = auto). `nodes`: (address, CPUs) of a Ray cluster's alive nodes when the workers run
    on one this server did not start; `here`: this machine's addresses; `cores`: this machine's
    cores (default os.cpu_count())."""
    if requested is not None:
        return ThreadChoice(requested, "--threads-per-worker")
    omp = env_threads(os.environ if env is None else env)
    if omp is not None:
        return ThreadChoice(omp, f"{OMP_ENV} in the environment")
    local = cores if cores is not None else os.cpu_count() or 1
    with_cpus = [(a, c) for a, c in nodes or () if c >= 1]
    if with_cpus and any(a not in (*LOOPBACK, *here) for a, _ in with_cpus):
        per_node = int(min(c for _, c in with_cpus))
        on_each = math.ceil(workers / len(with_cpus))
        return ThreadChoice(
            auto_threads(per_node, on_each),
            f"auto: {per_node} CPUs per Ray node / {on_each} workers per node ({len(with_cpus)} nodes)",
        )
    usable = max(1, local - ROUTER_CORES)
    return ThreadChoice(
        auto_threads(usable, workers),
        f"auto: {local} cores, {ROUTER_CORES} left to the router, / {workers} workers on this host",
        router_cores=local - usable,
    )


def choose_prompt_threads(
    requested: int | None, workers: ThreadChoice, n_workers: int, whole_colocated: bool
) -> ThreadChoice:
    """Threads of a worker's prompt steps (module docstring: why). `requested`: --prompt-threads
    (None = auto); `workers`: the workers' own choice; `whole_colocated`: a colocated server
    without --chunk-size."""
    if requested is not None:
        return ThreadChoice(requested, "--prompt-threads")
    if whole_colocated and workers.router_cores:
        extra = workers.router_cores // max(1, n_workers)
        if extra:
            return ThreadChoice(
                workers.threads + extra, f"auto: whole prompts colocated also take the router's {extra} core(s)"
            )
    return ThreadChoice(workers.threads, "auto: as the worker's")


def ray_nodes(ray: Any) -> tuple[list[tuple[str, float]], list[str]]:
    """(address, CPUs) of the connected Ray cluster's alive nodes, and this process's address."""
    nodes = [(n["NodeManagerAddress"], float(n["Resources"].get("CPU", 0.0))) for n in ray.nodes() if n.get("Alive")]
    return nodes, [ray.util.get_node_ip_address()]


def parse_threads(value: Any) -> int | None:
    """A --threads-per-worker value (CLI string or YAML scalar): a whole number, or `auto` (None).
    Raises ValueError for anything else; whether it is >= 1 is ServeConfig.validate's check."""
    if value is None or isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise ValueError(value)
