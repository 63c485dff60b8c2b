"""`pdserve bench probe`: the article's arithmetic measured on any OpenAI-compatible server.

`command`, `plan` (what to measure), `client` (prompts of exact lengths, one stream at a time),
`measure` (each black-box experiment), `run` (one probe in order, then the fits), `report`.

May import: `benchmarks.client`, `costmodel`.
"""
