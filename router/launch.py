"""Start the prefill and decode pools, as Ray actors or in-process, and build the Orchestrator.

Ray placement: one placement group per pool, one bundle per worker
({"CPU": threads, "GPU": gpus_per_worker} plus the pool's custom resources, e.g. {"prefill_node": 1}
to pin a pool to labelled nodes), where `threads` is the worker's intra-op thread count
(--threads-per-worker, router/workers/threads.py): the actor asks for as many CPUs as it uses. A
dead actor is replaced by a fresh one in the same bundle.
`ray_address="none"` runs the same worker classes as plain objects in this process (GPU
benchmarks without Ray, quick local checks).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from dataclasses import dataclass, field
from dataclasses import replace as with_fields
from pathlib import Path
from typing import Any

from contracts.worker import WorkerConfig
from costmodel.article.cost_model import Calibration, ModelSpec
from costmodel.article.layerwise import CPU_OVERLAP_COST
from engine.config import CacheConfig, is_checkpoint_dir, read_generation_eos, resolve_model_config
from engine.kv.layout import KVLayout
from router.dispatch.dispatcher import DEFAULT_CHUNK, AutoDispatcher
from router.dispatch.kv_transfer_policy import KVTransferPolicy
from router.lifecycle.orchestrator import Orchestrator
from router.workers.handle import WorkerHandle
from router.workers.host import load_worker_class, ray_actor_class
from router.workers.ray_cluster import connect_ray, start_local_ray
from router.workers.rss_watch import RSS_WARMUP_STEPS, RssWatch
from router.workers.threads import ThreadChoice, choose_prompt_threads, choose_threads, ray_nodes

log = logging.getLogger("pdserve.launch")
# where `pdserve bench chunks --out-dir benchmarks/results` leaves committed calibrations (not
# costmodel.provenance's constant: that module may import torch, and the router process must not)
RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@dataclass
class PoolSpec:
    role: str  # "prefill" | "decode" | "colocated"
    size: int
    worker_config: WorkerConfig
    gpus_per_worker: float = 0.0
    resources: list[dict[str, float]] = field(default_factory=list)  # per worker (bundle); [] = none

    @property
    def cpus(self) -> float:
        """CPUs Ray reserves for each worker: as many as its intra-op threads."""
        return float(self.worker_config.torch_threads or 1)


def _worker_args(spec: PoolSpec, name: str) -> tuple:
    if spec.role == "prefill":
        return (spec.worker_config, name)
    return (spec.worker_config, name, spec.role == "colocated")


class RayPools:
    """Owns the placement groups and actors of every pool; replaces dead actors."""

    def __init__(self, specs: list[PoolSpec]):
        import ray  # noqa: PLC0415
        from ray.util.placement_group import placement_group  # noqa: PLC0415

        self.ray = ray
        self.specs = {s.role: s for s in specs}
        self.groups = {}
        self._serial = 0
        for s in specs:
            base = {"CPU": s.cpus, **({"GPU": s.gpus_per_worker} if s.gpus_per_worker else {})}
            bundles = [{**base, **self._custom(s, i)} for i in range(s.size)]
            self.groups[s.role] = placement_group(bundles, strategy="PACK", name=f"pdserve-{s.role}-{os.getpid()}")

    @staticmethod
    def _custom(spec: PoolSpec, bundle: int) -> dict[str, float]:
        return dict(spec.resources[bundle]) if spec.resources else {}

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(pg.ready() for pg in self.groups.values())), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(
                "placement groups not ready in time: the cluster lacks the resources "
                f"for {', '.join(f'{s.size} {r}' for r, s in self.specs.items())} workers of "
                f"{', '.join(f'{s.cpus:g}' for s in self.specs.values())} CPUs each "
                "(check --threads-per-worker, --gpus-per-worker and the pools' custom resources)"
            ) from None

    def spawn(self, role: str, bundle: int) -> WorkerHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        spec = self.specs[role]
        self._serial += 1
        name = (
            f"{role}-{bundle}"
            if self._serial <= sum(s.size for s in self.specs.values())
            else f"{role}-{bundle}-r{self._serial}"
        )
        actor_cls = ray_actor_class(self.ray, role)
        actor = actor_cls.options(
            name=f"pdserve-{name}-{os.getpid()}",
            # threaded, in its concurrency groups (router/workers/host.py): calls run side by side
            allow_out_of_order_execution=True,
            max_restarts=0,
            num_cpus=spec.cpus,
            num_gpus=spec.gpus_per_worker,
            resources=self._custom(spec, bundle) or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.groups[role], placement_group_bundle_index=bundle
            ),
        ).remote(role, *_worker_args(spec, name))
        return WorkerHandle(name, "prefill" if role == "prefill" else "decode", actor, is_ray=True, bundle=bundle)

    async def replace(self, dead: WorkerHandle) -> WorkerHandle | None:
        role = "prefill" if dead.role == "prefill" else next(r for r in self.specs if r != "prefill")
        try:
            self.ray.kill(dead.target, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        new = self.spawn(role, dead.bundle)
        try:
            await asyncio.wait_for(new.ping(), 120)
        except Exception as e:  # noqa: BLE001
            log.error("replacement for %s failed to start: %r", dead.name, e)
            try:  # a half-started actor would keep the bundle that the next attempt needs
                self.ray.kill(new.target, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            return None
        return new

    async def shutdown(self, handles: list[WorkerHandle]) -> None:
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

        await asyncio.gather(*(h.shutdown() for h in handles if h.alive), return_exceptions=True)
        for h in handles:
            try:
                self.ray.kill(h.target, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for pg in self.groups.values():
            remove_placement_group(pg)


def init_ray(address: str | None, cpus_needed: int) -> bool:
    """Connect to `address`, or start an embedded local Ray sized for the pools (`cpus_needed`: the
    workers' CPUs and one spare), in a private network namespace where Linux allows it; token
    authentication either way (router.workers.ray_cluster). Returns True if this process started Ray (and
    so should shut it down)."""
    import ray  # noqa: PLC0415 - Ray is loaded only when pools run on it

    if ray.is_initialized():  # started by the caller (tests, benchmarks), with token auth too
        return False
    if address:
        connect_ray(address)
        return True
    how = start_local_ray(
        # never fewer than the pools need, whatever the machine has: a 2P2D server starts on 2 cores
        num_cpus=max(os.cpu_count() or 1, cpus_needed),
        object_store_bytes=256 * 1024**2,
        temp_dir=os.path.join(tempfile.gettempdir(), "pdserve-ray"),
        private_network=True,
    )
    log.info("embedded Ray: token auth, %s", "private network namespace" if how["private_network"] else "loopback")
    return True


def pool_specs(cfg: Any, threads: int | None = None, prompt_threads: int | None = None) -> list[PoolSpec]:
    """PoolSpecs from a router.config.ServeConfig; `threads`: each worker's intra-op threads (None:
    as the config says, --threads-per-worker or torch's default), `prompt_threads` its prompt
    steps' (None: as the config says)."""
    wc = cfg.worker_config()
    if threads is not None:
        wc = with_fields(wc, torch_threads=threads)
    if prompt_threads is not None:
        wc = with_fields(wc, prompt_threads=prompt_threads)
    if cfg.mode == "colocated":
        return [PoolSpec("colocated", cfg.decode, wc, cfg.gpus_per_worker, cfg.resources_per_worker("decode"))]
    dc = wc
    if cfg.mode == "auto":  # prompts the router keeps local are prefilled in chunks on the decode worker
        wc, dc = with_fields(wc, chunk_size=None), with_fields(wc, chunk_size=cfg.chunk_size or DEFAULT_CHUNK)
    return [
        PoolSpec("prefill", cfg.prefill, wc, cfg.gpus_per_worker, cfg.resources_per_worker("prefill")),
        PoolSpec("decode", cfg.decode, dc, cfg.gpus_per_worker, cfg.resources_per_worker("decode")),
    ]


def build_dispatcher(cfg: Any, model_dir: str) -> AutoDispatcher | None:
    """--mode auto: the dispatcher, priced by --calibration (or the one `pdserve bench chunks`
    left for this model and device in benchmarks/results/)."""
    if cfg.mode != "auto":
        return None
    path = cfg.calibration
    if path is None:
        kind = "cuda" if cfg.device.startswith("cuda") else "cpu"
        name = resolve_model_config(model_dir).name  # what `bench chunks` names its files after
        path = str(RESULTS_DIR / f"chunks-{name}-{kind}.calibration.json")
        if not Path(path).is_file():
            raise ValueError(
                f"--mode auto needs a calibration: pass --calibration FILE, or run "
                f"`pdserve bench chunks --model {cfg.model} --out-dir benchmarks/results` (expected {path})"
            )
    cal = Calibration.load(path)
    warning = cal.origin_warning(path)
    if warning:
        log.warning("--mode auto: %s; its step prices may be off here", warning)
    return AutoDispatcher(
        cal,
        ModelSpec.from_config(resolve_model_config(model_dir)),
        cfg.kv_dtype,
        cfg.chunk_size,
        cfg.slo_ttft_ms / 1e3,
        cfg.slo_itl_ms / 1e3,
    )


def kv_transfer_policy(cfg: Any) -> KVTransferPolicy | None:
    """--kv-transfer: which remote prefills stream their KV layer by layer (None: colocated)."""
    if cfg.mode == "colocated":
        return None
    model_cfg = resolve_model_config(cfg.model)
    layout = KVLayout.build(model_cfg, CacheConfig(block_size=cfg.block_size, num_blocks=1, kv_dtype=cfg.kv_dtype))
    return KVTransferPolicy(
        getattr(cfg, "kv_transfer", "bulk"),
        getattr(cfg, "kv_stream_layers", 1),
        layout.num_layers,
        layout.bytes_per_token,
        getattr(cfg, "link_gbps", None),
        overlap_cost=CPU_OVERLAP_COST if cfg.device == "cpu" else 0.0,  # a CPU prefill shares its cores
    )


def rss_watch(cfg: Any) -> RssWatch | None:
    """The worker memory watch `--rss-growth-warn-mb` asks for (None when it is 0)."""
    bound = getattr(cfg, "rss_growth_warn_mb", 0)
    return RssWatch(bound, getattr(cfg, "rss_warmup_steps", RSS_WARMUP_STEPS)) if bound else None


def _log_threads(cfg: Any, choice: ThreadChoice, workers: int) -> tuple[int, int]:
    """(threads, prompt-step threads) of each worker, logged."""
    whole_colocated = cfg.mode == "colocated" and cfg.chunk_size is None
    prompt = choose_prompt_threads(getattr(cfg, "prompt_threads", None), choice, workers, whole_colocated)
    log.info(
        "workers: %d intra-op torch threads each (%s); prompt steps %d (%s)",
        choice.threads,
        choice.why,
        prompt.threads,
        prompt.why,
    )
    return choice.threads, prompt.threads


async def build_orchestrator(cfg: Any) -> Orchestrator:
    """Start every worker described by `cfg` (a ServeConfig) and return a started Orchestrator."""
    model_cfg = resolve_model_config(cfg.model)
    eos = tuple(read_generation_eos(cfg.model)) if is_checkpoint_dir(cfg.model) else ()
    workers = sum(s.size for s in pool_specs(cfg))
    asked = getattr(cfg, "threads_per_worker", None)
    dispatcher = build_dispatcher(cfg, cfg.model)  # before any worker starts: a bad calibration fails fast
    handles: dict[str, list[WorkerHandle]] = {}
    if cfg.ray_address == "none":
        specs = pool_specs(cfg, *_log_threads(cfg, choose_threads(asked, workers), workers))
        loop = asyncio.get_running_loop()
        for s in specs:
            cls = load_worker_class(s.role)  # in-process workers: this process runs the engine
            names = [f"{s.role}-{i}" for i in range(s.size)]
            objs = await asyncio.gather(
                *(loop.run_in_executor(None, cls, *_worker_args(s, n)) for n in names), return_exceptions=True
            )
            handles[s.role] = [
                WorkerHandle(n, "prefill" if s.role == "prefill" else "decode", o, is_ray=False)
                for n, o in zip(names, objs)
                if not isinstance(o, BaseException)
            ]
            failed = next((o for o in objs if isinstance(o, BaseException)), None)
            if failed is not None:  # stop the workers that did start (loop threads, registered pools)
                for h in (h for hs in handles.values() for h in hs):
                    h.target.shutdown()
                raise failed

        async def shutdown_local(workers: list[WorkerHandle]) -> None:
            await asyncio.gather(*(h.shutdown() for h in workers), return_exceptions=True)

        replace, on_shutdown = None, shutdown_local
    else:
        import ray  # noqa: PLC0415

        if ray.is_initialized() or cfg.ray_address:  # a cluster this server joins: its nodes say
            started = init_ray(cfg.ray_address, 0)
            choice = choose_threads(asked, workers, None, *ray_nodes(ray))
        else:  # the embedded cluster, sized for the threads chosen
            choice = choose_threads(asked, workers)
            started = init_ray(None, choice.threads * workers + 1)
        specs = pool_specs(cfg, *_log_threads(cfg, choice, workers))
        pools = RayPools(specs)
        try:
            await pools.wait_ready()
            for s in specs:
                handles[s.role] = [pools.spawn(s.role, i) for i in range(s.size)]
            every = [h for hs in handles.values() for h in hs]
            await asyncio.gather(*(h.ping() for h in every))  # raises if a worker failed to build
        except BaseException:
            await pools.shutdown([h for hs in handles.values() for h in hs])
            if started:
                ray.shutdown()
            raise

        async def shutdown_ray(workers: list[WorkerHandle]) -> None:
            await pools.shutdown(workers)
            if started:
                ray.shutdown()

        replace, on_shutdown = pools.replace, shutdown_ray
    orch = Orchestrator(
        cfg.mode,
        model_cfg,
        handles.get("prefill", []),
        handles.get("decode", handles.get("colocated", [])),
        cfg.policy,
        eos,
        replace,
        on_shutdown,
        link_gbps=getattr(cfg, "link_gbps", None),
        dispatcher=dispatcher,
        block_size=cfg.block_size,
        rss_watch=rss_watch(cfg),
        kv_policy=kv_transfer_policy(cfg),
    )
    await orch.start()
    return orch
