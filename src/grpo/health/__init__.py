"""Health checks: why a run is not learning, said from the metrics it already logs.

checks (the registered checks, pure functions of a step's metrics and a short history),
monitor (their state across steps: firing and clearing, the console lines, `health/*`
metrics, health.fail_on) and diagnosis (the same findings from a run directory's files, for
`grpo doctor` and report.md). Torch-free: it imports only grpo.config, grpo.registry and the
standard library.
"""
