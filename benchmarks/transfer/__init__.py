"""KV transfer measured: `bench transfer` (two processes against the article's links),
`bench layerwise` (what streaming takes off the critical path), `cluster_report` (the
rehearsal's link table).

May import: `benchmarks.engine` (shared flags), `benchmarks.compare` (the link probe), `costmodel`.
"""
