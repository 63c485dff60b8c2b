"""The paged KV pool: its byte layout, the pool itself, and the ledger of its blocks.

`layout` (the contract between two workers' pools), `cache` (one contiguous byte tensor),
`block_manager` (free list, reference counts, prefix caching), `prefix_cache` (block hashes).

May import: `engine.config`.
"""
