"""The article's arithmetic as pure functions of model, hardware and workload.

`cost_model` (prefill, decode and transfer times), `layerwise` (what layer-wise streaming
leaves exposed), `kv_capacity` (how many sequences a KV pool holds).

May import: `costmodel.fit` (a calibration prices with measured figures), `costmodel.datasheets`.
"""
