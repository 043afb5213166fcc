"""The job store schema, one tuple of statements per version, shared by SQLite and PostgreSQL.

`{serial}`, `{float}` and `{blob}` are filled from the dialect. JSON columns are text: a request body
comes back byte-for-byte as sent (jsonb would reorder its keys).
"""

from __future__ import annotations

_V1_JOBS = """
CREATE TABLE jobs (
    num {serial},
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    request TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at {float} NOT NULL,
    started_at {float},
    finished_at {float},
    progress_tokens INTEGER NOT NULL DEFAULT 0,
    text TEXT NOT NULL DEFAULT '',
    result TEXT,
    error TEXT,
    worker_id TEXT,
    lease_expires_at {float},
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
    last_seq INTEGER NOT NULL DEFAULT 0,
    batch_id TEXT,
    custom_id TEXT
)"""

_V1_EVENTS = """
CREATE TABLE job_events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    text TEXT NOT NULL,
    token_ids TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
)"""

_V1_FILES = """
CREATE TABLE files (
    num {serial},
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at {float} NOT NULL,
    data {blob} NOT NULL
)"""

_V1_BATCHES = """
CREATE TABLE batches (
    num {serial},
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    created_at {float} NOT NULL,
    expires_at {float} NOT NULL,
    in_progress_at {float},
    finalizing_at {float},
    completed_at {float},
    failed_at {float},
    expired_at {float},
    cancelling_at {float},
    cancelled_at {float},
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    metadata TEXT
)"""

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        _V1_JOBS,
        _V1_EVENTS,
        _V1_FILES,
        _V1_BATCHES,
        # NOTE: claims scan only unfinished jobs, so finished history does not slow the queue down.
        "CREATE INDEX jobs_unfinished ON jobs (num) WHERE status IN ('queued', 'running')",
        "CREATE INDEX jobs_status ON jobs (status)",
        "CREATE INDEX jobs_batch ON jobs (batch_id, num)",
    ),
)
