"""What the router shows about itself: metrics, traces, logs, and each request's timeline.

`timeline` (every phase of a request, stamped as it happens, typed), `trace_phases` (a timeline
as consecutive trace intervals), `tracing` (OpenTelemetry over OTLP/HTTP), `metrics`
(Prometheus, on a private registry), `logs` (text or JSON lines).

May import: nothing else of `router`.
"""
