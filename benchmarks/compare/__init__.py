"""`pdserve bench compare`: pdserve's modes (or outside servers) on one workload, measured
beside the simulator.

`command` (the command: the pipeline's stages in order), `pipeline` (`CompareRun` and the
stages), `args` (the flags), `modes` and `endpoints` (running the servers), `calibrate/`
(each server's own steps, fitted; `--transfer-from`), `prediction` (which device model predicts each mode),
`equality` (same requests, same tokens), `record` (what one run holds), `auto`, `table`,
`markdown`, `plots`, `demo_samples`, `link_probe`.

May import: `benchmarks.client`, `benchmarks.probe`, `costmodel`.
"""
