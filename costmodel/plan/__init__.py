"""`pdserve plan`: which deployment to run for a workload and its SLOs, simulated, not measured.

`candidates` (the deployments a worker budget allows: colocated whole, chunked at each useful
size, every xPyD split), `score` (each simulated on the calibrated device model, its SLO
attainment and goodput per worker, ranked), `risk` (each top candidate's chance of missing an
SLO at the fit's error, and the goodput it leaves), `pricing` (which fit prices which candidate,
and where it does not cover the workload), `report` (the table, and why the winner wins),
`trace` (a JSONL workload: arrivals, lengths, shared prefixes).

May import: `costmodel.sim`, `costmodel.article`, `costmodel.workloads`, `costmodel.serve_metrics`.
"""
