"""KV transfer measured: `bench transfer` (two processes against the article's links),
`bench layerwise` (what streaming takes off the critical path; `layerwise_shot.py` ->
`layerwise_summary.py` -> `layerwise.py`), `cluster_report` (the rehearsal's link table).

May import: `benchmarks.engine` (shared flags), `benchmarks.compare` (the link probe), `costmodel`.
"""
