"""Continuous batching: the scheduler decides each step, the engine runs it.

`scheduler` (one `ScheduledBatch` per step), `llm_engine` (requests in, steps run, tokens out).

May import: `engine.runner`, `engine.kv`, `engine.sequence`.
"""
