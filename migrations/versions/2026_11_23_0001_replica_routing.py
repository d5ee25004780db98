"""request_log gains the replica that served the request and the gateway's predicted cached tokens.

Revision ID: 2026_11_23_replica_routing
Revises: 0001_request_log
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_23_replica_routing"
down_revision = "0001_request_log"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.add_column(sa.Column("replica", sa.String(64), nullable=True))
        batch.add_column(sa.Column("predicted_cached_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("request_log") as batch:
        batch.drop_column("predicted_cached_tokens")
        batch.drop_column("replica")
