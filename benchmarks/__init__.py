"""Measurements: every `pdserve bench` command, each writing JSON with provenance.

Packages: `client/` (load generation, `bench serve`), `compare/` (`bench compare`), `probe/`
(`bench probe`), `engine/` (in-process engine benchmarks), `transfer/` (KV transfer), `soak/`
(reliability and memory over time), `gpu/` (CUDA only). `serve_process.py`: `pdserve serve` as a child
process, for the benchmarks that start their own servers. Results go to `results/`.

May import: everything below it (router, workers, contracts, costmodel, transport, engine).
"""
