"""`--mode auto` and `--kv-transfer`: per request, where its prompt runs and how its KV moves.

`dispatcher` (the policy), `replay` (its model of each prefill queue), `stats` (how far its
predictions fell), `types` (what it reads and answers), `kv_transfer_policy` (bulk or
layer-wise), `shared_cores` (which steps ran while the other pool was busy).

May import: `router.observe` (the timeline).
"""
