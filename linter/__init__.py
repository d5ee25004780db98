"""``prefixgate lint``: finds what breaks prefix caching in request logs and prompt code."""
