"""Live tuning of replicas, maxNumSeqs and gpuMemoryUtilization from Prometheus metrics.

``policy`` decides (pure), ``knobs`` maps the spec to the policy's terms, ``prometheus``
observes, ``record`` writes the status, ``runner`` ties one window together for the kopf
timer, and ``sim`` replays the same policy against a model of the engine.
"""
