"""The pagoda operator: turns LLMDeployment objects into running inference servers.

Everything that decides something lives in pure modules (``spec``, ``engine_args``,
``desired``, ``status``) that take plain dicts and return plain dicts; ``handlers`` and
``reconcile`` only move those dicts between kopf and the Kubernetes API.
"""

__version__ = "0.1.0"
