"""Grammar-constrained decoding: compiled grammars (cached by spec) and per-request token masks."""
