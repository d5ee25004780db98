"""stored_response: the Responses API's stored responses (previous_response_id, GET/DELETE).

Revision ID: 2026_11_24_stored_responses
Revises: 2026_11_23_replica_routing
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "2026_11_24_stored_responses"
down_revision = "2026_11_23_replica_routing"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_response",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False),
        sa.Column("input_items", sa.LargeBinary(), nullable=False),
        sa.Column("output_items", sa.LargeBinary(), nullable=False),
        sa.Column("response", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ix_stored_response_expires_at", "stored_response", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_response_expires_at", table_name="stored_response")
    op.drop_table("stored_response")
