"""The OpenAI-compatible HTTP server: FastAPI app, protocol models, metrics, probes."""
