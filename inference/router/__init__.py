"""``pagoda router``: one OpenAI endpoint in front of many engines, for clusters without a
Gateway that implements the Gateway API inference extension.

It routes each request by its ``model`` to the engines serving it, keeps a conversation on
the engine that caches its prefix (consistent hashing with bounded load), falls back to the
least-loaded engine by the engines' own ``/metrics``, retries on another engine a request
that never started, and passes streams through unbuffered. It talks to the engines over
HTTP only and imports nothing of the engine (tests/test_layering.py).
"""
