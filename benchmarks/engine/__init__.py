"""Benchmarks of the engine in-process: `bench step`, `bench article`, `bench chunks`,
`bench kvcache`, `bench quality`.

`toolkit` and `harness` (the engine under a benchmark), `cli` (the flags and the table they
share), `timing`, `device_probe` (what this device does, measured in the same run).

May import: `benchmarks.client` (workloads), `engine`, `costmodel`.
"""
