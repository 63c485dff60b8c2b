"""The discrete-event serving simulator, and its predictions beside a benchmark.

`engine` (the event loop, colocated and disaggregated pools), `model` (requests and token
times), `workers` (each simulated worker's next step), `plot`, `compare_predict` (the simulator
run on exactly a benchmark's workload), `stall_jitter` (a predicted stall drawn with the steps'
measured scatter).

May import: `costmodel.article`, `costmodel.fit`, `costmodel.workloads`, `costmodel.serve_metrics`.
"""
