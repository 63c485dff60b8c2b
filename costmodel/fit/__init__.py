"""Fitting the cost model to measurements: the solver, the step fit, the probe's fit, the file.

`nnls` (non-negative least squares on relative error), `step_fit` (what one engine step costs),
`probe_fit` (the article's model fitted from outside a server), `calibration` (the file a
benchmark writes and the cost model reads).

May import: `costmodel.datasheets`, `costmodel.machine`.
"""
