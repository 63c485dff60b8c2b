"""Talking to an OpenAI-compatible server under load, and `pdserve bench serve`.

`serve_client` (the async load generator and its records), `bench_serve` (the command),
`multiturn` (the chat workload whose history grows), `gc_pauses` (the collector kept out of
timed runs), `step_log` (a pdserve server's step log recorded while load runs) and `logged_step`
(one step of it).

May import: `costmodel`; nothing else of `benchmarks`.
"""
