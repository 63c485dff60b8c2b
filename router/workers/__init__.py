"""The workers as the router holds them: handles, health, the Ray actor host, threads, RSS.

`handle` (one call path for Ray actors and in-process workers), `health` (dead workers found and
replaced), `host` (the class Ray turns into an actor), `threads` (`--threads-per-worker`),
`ray_cluster` (token-authenticated clusters), `rss_watch` (memory growth warnings).

May import: nothing else of `router`.
"""
