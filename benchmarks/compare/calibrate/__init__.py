"""What predicts a `bench compare` mode: `calibration` (each server's own warm-up steps, fitted per
pool; benchmarks/client/step_log.py records them), `side_requests` (the requests beside the warm-up:
the serving hop, prompts of other lengths), `transfer` (`--transfer-from`: an earlier run's fits),
`scatter` (the decode steps' scatter a predicted stall is drawn with), `contention` (two pools on one
host's cores: each one's steps beside the other's), `fit_trim` (a fit without the steps that ran cold).

May import: `costmodel`, `engine.config`.
"""
