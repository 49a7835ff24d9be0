"""GPU checks and benchmark programs of the repository (run from its root, ``python -m
benchmarks.NAME``), and their results (``results/``, RESULTS.md). Not part of the installed
package: ``pagoda bench latency|throughput|serve`` (``inference.bench``) is what users run."""
