"""The engine benchmarks' shared toolkit under one name: `bench chunks`, `bench article` and
`bench step` import it as `eb` and call `eb.Harness`, `eb.measure`, `eb.table`, ...

Nothing is defined here; each name lives in the module of its role:

- `benchmarks/engine/timing.py`: timers (`time_call`, `measure`);
- `benchmarks/engine/device_probe.py`: what the device can do (copy bandwidth, GEMM rate) and what the
  machine is (CPU name, memory, load);
- `benchmarks/engine/harness.py`: one ModelRunner with a KV pool, its decode batches, and the
  device spec the cost model predicts with;
- `benchmarks/engine/cli.py`: the shared flags, their parsing, the printed table and the plots' finish.
"""

from __future__ import annotations

from benchmarks.engine.cli import (
    add_common_arguments,
    add_device_and_dtypes,
    config_record,
    parse_ints,
    resolve_device,
    save_figure,
    swept_axis,
    table,
)
from benchmarks.engine.device_probe import DeviceProbe, copy_bandwidth, cpu_name, load_average, mem_bytes, probe_device
from benchmarks.engine.harness import Harness, cuda_kv_budget, default_model, fill_kv_random, kv_pool_bytes
from benchmarks.engine.timing import Timing, measure, sync, time_call

__all__ = [
    "sync",
    "time_call",
    "Timing",
    "measure",
    "DeviceProbe",
    "copy_bandwidth",
    "probe_device",
    "load_average",
    "cpu_name",
    "mem_bytes",
    "resolve_device",
    "parse_ints",
    "table",
    "swept_axis",
    "save_figure",
    "add_common_arguments",
    "add_device_and_dtypes",
    "config_record",
    "cuda_kv_budget",
    "kv_pool_bytes",
    "default_model",
    "Harness",
    "fill_kv_random",
]
