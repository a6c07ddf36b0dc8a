"""The engine core: requests in, one scheduler step at a time, deltas out.

`api.py` is the engine's public seam (requests, deltas, errors, sampling parameters, the
`EngineClient` protocol): the gateway, the routing layer and compression program against it.
"""
