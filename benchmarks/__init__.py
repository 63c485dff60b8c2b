"""Measurements: every `pdserve bench` command, each writing JSON with provenance.

Packages: `client/` (load generation, `bench serve`), `compare/` (`bench compare`), `probe/`
(`bench probe`), `engine/` (in-process engine benchmarks), `transfer/` (KV transfer), `soak/`
(reliability and memory over time), `gpu/` (CUDA only). Results go to `results/`.

May import: everything below it (router, workers, contracts, costmodel, transport, engine).
"""
