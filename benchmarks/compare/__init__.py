"""`pdserve bench compare`: pdserve's modes (or outside servers) on one workload, measured
beside the simulator.

`command` (the pipeline), `args` (its flags), `modes` and `endpoints` (running the servers),
`calibration` and `calibration_file` (the step model the predictions use), `prediction`,
`equality` (same requests, same tokens), `record` (what one run holds), `auto`, `table`,
`markdown`, `plots`, `demo_samples`, `link_probe`.

May import: `benchmarks.client`, `benchmarks.probe`, `costmodel`.
"""
