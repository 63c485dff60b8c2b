"""The engine both pools run: the FP8 Llama, its paged KV pool, continuous batching.

Packages: `kv/` (the pool and its ledger), `model/` (the model and its operators, C++ kernels in
`model/csrc/`), `checkpoint/` (real models), `runner/` (one step as one forward pass), `core/`
(scheduler and engine), `gpu/` (the CUDA path). Beside them: `config.py`, `sequence.py`,
`gguf_file.py`, `torch_compat.py` (torch's private APIs, in one place), `worker_base.py` (the
engine loop a worker runs), `heap_trim.py`, and the `pdserve generate` / `pdserve model` CLIs.

May import: nothing of pdserve but `cli` (CliError); it is the bottom layer.
"""
