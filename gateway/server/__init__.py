"""The gateway as a process: the Starlette app with its exception handlers and
lifespan, the settings assembled from the command line, the launcher (one process) and
the supervisor (several workers on one socket with shared history and metrics), the
engine child of ``prefixgate serve``, free-port checks and dying with the parent.
"""
