"""Reliability and memory over time: `bench soak` (load while workers are killed),
`rss_loads` and `bench rss-shapes` (worker memory under ever new prompt lengths).

May import: `benchmarks.engine` (shared flags), `benchmarks.serve_process` (the server as a child process),
`costmodel`.
"""
