"""The HTTP server of ``moee serve``: ``app`` (endpoints, limits, metrics), ``batcher`` (dynamic
batching), ``protocol`` (request and response shapes), ``client`` (a small client, used by
``moee search --server``). Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client)."""
