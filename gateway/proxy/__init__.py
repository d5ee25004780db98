"""One request through the gateway: the handler (authenticate, read, canonicalize, warn,
route, relay, record), the bounded body reading and parsing, and the relays that pass a
JSON answer or an SSE stream back while they read its usage into the request record.
"""
