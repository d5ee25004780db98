"""``prefixgate`` subcommands owned by the gateway package (parsers only at import)."""
