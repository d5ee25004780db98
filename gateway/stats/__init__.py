"""What the gateway remembers and shows: the SQLite ``request_log`` table (one row per
request), its batched writer, the database set-up and Alembic upgrade, the per-tenant
and per-replica reports of ``prefixgate stats``, Prometheus metrics, and the HTML
dashboard. Reads request records; never changes a request.
"""
