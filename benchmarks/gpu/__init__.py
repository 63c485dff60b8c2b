"""`pdserve bench gpu` (CUDA only): ceilings, decode and prefill against the roofline, the KV
transfer on the device, colocation; runs without Ray (workers as plain classes).

May import: `engine`, `transport`, `costmodel`; nothing else of `benchmarks`.
"""
