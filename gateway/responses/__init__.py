"""The Responses API on the gateway's side: the Responses body's chat view and its
canonicalization, the stored responses table with its limits and TTL, a stored turn
joined to the next request (``previous_response_id``), and the ``GET``/``DELETE``
``/v1/responses/{id}`` routes. The translation itself is the engine contract's.
"""
