"""Which replica serves a request: the replica set and its health, the router's choice
by cached prefix and load, the request's block keys (the engine's block hashes over the
rendered chat template), the per-replica block index fed by KV events over ZMQ, and the
per-replica metrics. One upstream per replica, from ``upstream/``.
"""
