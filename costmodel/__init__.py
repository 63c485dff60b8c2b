"""The cost model (the article's arithmetic), its CLI, the serving simulator, and the predictions
`bench compare` sets beside its measurements, with the vocabulary they share with the benchmarks
(workloads, serving metrics, result files). Pure Python: nothing here imports torch at module level.
"""
