"""The CUDA path of the engine: the paged FP8 decode kernel (Triton), the CUDA attention
backend, CUDA-graph capture of the decode step, and single-GPU disaggregation on green contexts.

Every module here imports on a CPU-only machine; the CUDA-only pieces check for a device when
they are used, not when they are imported. The Triton kernel's logic is checked on CPU with the
Triton interpreter (`TRITON_INTERPRET=1`, see tests/test_gpu_kernels.py).
"""
