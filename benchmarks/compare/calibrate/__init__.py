"""What predicts a `bench compare` mode: `calibration` (each server's own warm-up steps, fitted per
pool; benchmarks/client/step_log.py records them), `side_requests` (the requests beside the warm-up:
the serving hop, prompts of other lengths), `transfer` (`--transfer-from`: an earlier run's fits),
`scatter` (the decode steps' scatter a predicted stall is drawn with).

May import: `costmodel`, `engine.config`.
"""
