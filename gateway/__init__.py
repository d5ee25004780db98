"""prefixgate's OpenAI-compatible gateway and the ``prefixgate`` command line.

Wings by concern, each importing only the wings below it (``tests/gateway/test_gw_layout.py``
enforces the order, lowest first): the ground (``errors``, ``request_record``: plain data),
``config/``, ``policy/``, ``stats/``, ``responses/``, ``upstream/``, ``routing/``,
``proxy/``, ``server/``, ``commands/``; ``cli`` dispatches to the commands by name. What
the gateway shares with the engine and the linter byte for byte it imports from the
engine's torch-free contract, never from the engine's server or model.
"""
