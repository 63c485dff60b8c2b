"""A request's life between the pools: admit, place, prefill, hand off, decode, finish.

`orchestrator` (the lifecycle), `placement` and `prefix_index` (which worker), `request_state`
(one live request), `decode_streams` (each decode worker's batch as the router sees it),
`worker_pools` (the pools running beside the requests).

May import: `router.dispatch`, `router.workers`, `router.observe`.
"""
