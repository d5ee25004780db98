"""What the gateway is told: the TOML config (tenants, keys, canonicalization switches,
upstream kinds), its editor for ``prefixgate keys``, the replica and routing tables of
``--upstream``/``[[upstreams]]``, and the private runtime directory for sockets and
pipes. Parsing only: values in, frozen dataclasses out, a ``ValueError`` naming the bad
value; nothing here opens a connection or reads a request.
"""
