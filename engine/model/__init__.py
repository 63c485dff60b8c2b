"""The FP8 Llama and the operators it runs on.

`llama` (the model, top to bottom), `linear` (FP8 and dense projections, CPU GEMM layouts and
row buckets), `attention` (the reference over the paged pool), `cpu_attention` (the CPU hot
path), `attention_registry` (which backend a device gets), `cpu_kernels` (pdserve's C++ kernels
in `csrc/`, built once per machine).

May import: `engine.kv`, `engine.config`, `engine.torch_compat`; `engine.gpu.attention` (the
registry only).
"""
