-- Async traces and their dead-letter queue (SQLite). JSON columns are text
-- guarded by json_valid and kept byte for byte as written, so a trace's `data`
-- keeps the key order the workflow produced. Timestamps are microseconds since
-- the Unix epoch, as in 0001.

CREATE TABLE traces (
    trace_id         TEXT    NOT NULL PRIMARY KEY,
    channel          TEXT    NOT NULL,
    mode             TEXT    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'failed')),
    workflow_id      TEXT,
    workflow_version INTEGER,
    -- The rollout bucket of the submitting request: its inputs (authorization,
    -- client IP) are not stored, so the bucket is fixed at submission.
    bucket           INTEGER,
    payload          TEXT    NOT NULL CHECK (json_valid(payload)),
    metadata         TEXT    NOT NULL CHECK (json_valid(metadata)),
    data             TEXT    CHECK (data IS NULL OR json_valid(data)),
    errors           TEXT    NOT NULL CHECK (json_valid(errors)),
    -- Runs started so far; also the fencing token of the current run.
    attempts         INTEGER NOT NULL DEFAULT 0,
    created_at       INTEGER NOT NULL,
    started_at       INTEGER,
    completed_at     INTEGER,
    duration_ms      REAL,
    -- A running trace whose lease has passed is claimable again (crashed worker).
    lease_until      INTEGER
);
CREATE INDEX traces_claim ON traces (status, created_at);
CREATE INDEX traces_created ON traces (created_at, trace_id);
CREATE INDEX traces_channel ON traces (channel);

CREATE TABLE trace_dlq (
    trace_id      TEXT    NOT NULL PRIMARY KEY REFERENCES traces (trace_id) ON DELETE CASCADE,
    state         TEXT    NOT NULL CHECK (state IN ('waiting', 'exhausted')),
    attempts      INTEGER NOT NULL,
    next_retry_at INTEGER,
    last_error    TEXT    NOT NULL,
    created_at    INTEGER NOT NULL
);
CREATE INDEX trace_dlq_due ON trace_dlq (state, next_retry_at);
