"""Create request_log: one row per proxied request.

Revision ID: 0001_request_log
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_request_log"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "request_log",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("time", sa.DateTime(), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=True),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("upstream", sa.String(512), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("warning_codes", sa.Text(), nullable=False, server_default=""),
        sa.Column("canonicalization", sa.Text(), nullable=False, server_default=""),
        sa.Column("error_code", sa.String(64), nullable=True),
    )
    op.create_index("ix_request_log_tenant_time", "request_log", ["tenant", "time"])


def downgrade() -> None:
    op.drop_index("ix_request_log_tenant_time", table_name="request_log")
    op.drop_table("request_log")
