"""prefixgate's OpenAI-compatible gateway and the ``prefixgate`` command line."""
