"""The test session's Ray cluster: one per session (per pytest-xdist worker), not one per module.

A Ray start + shutdown costs 6-7 s on 2 cores and every serving module needs a cluster, so they
share one. Modules that need a cluster of another shape (two nodes) call `fresh_ray()` first;
the next module that asks for the shared one gets it started again. Servers stop their actors on
exit, so a module finds no other module's workers on it.
"""

from __future__ import annotations

SHARED_RAY = {"num_cpus": 8, "object_store_bytes": 128 * 1024**2}


def shared_ray() -> None:
    """Connect this process to the session's token-auth Ray cluster, starting it if needed."""
    import ray

    from router.workers.ray_cluster import start_local_ray

    if not ray.is_initialized():
        start_local_ray(log_to_driver=False, **SHARED_RAY)


def fresh_ray() -> None:
    """Leave the shared cluster (if this process is on one) so the caller can start its own."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
