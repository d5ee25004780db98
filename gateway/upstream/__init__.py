"""How the gateway talks to one upstream: the HTTP client with its error translation,
the bounded connection pool, the upstream kinds (engine, openai, llamacpp: what each is
sent, salt and tenant header included, and how its usage is read), and the stall
watchdog that cuts a stream that stops moving.
"""
