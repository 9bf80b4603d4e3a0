-- Async traces and their dead-letter queue (PostgreSQL). JSON columns are TEXT,
-- not JSONB: they are never queried by content, and text keeps a trace's `data`
-- byte for byte (JSONB would reorder keys). Timestamps are microseconds since
-- the Unix epoch, as in 0001.

CREATE TABLE traces (
    trace_id         VARCHAR(64)  NOT NULL PRIMARY KEY,
    channel          VARCHAR(255) NOT NULL,
    mode             VARCHAR(16)  NOT NULL,
    status           VARCHAR(16)  NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'failed')),
    workflow_id      VARCHAR(128),
    workflow_version BIGINT,
    -- The rollout bucket of the submitting request: its inputs (authorization,
    -- client IP) are not stored, so the bucket is fixed at submission.
    bucket           BIGINT,
    payload          TEXT         NOT NULL,
    metadata         TEXT         NOT NULL,
    data             TEXT,
    errors           TEXT         NOT NULL,
    -- Runs started so far; also the fencing token of the current run.
    attempts         BIGINT       NOT NULL DEFAULT 0,
    created_at       BIGINT       NOT NULL,
    started_at       BIGINT,
    completed_at     BIGINT,
    duration_ms      DOUBLE PRECISION,
    -- A running trace whose lease has passed is claimable again (crashed worker).
    lease_until      BIGINT
);
CREATE INDEX traces_claim ON traces (status, created_at);
CREATE INDEX traces_created ON traces (created_at, trace_id);
CREATE INDEX traces_channel ON traces (channel);

CREATE TABLE trace_dlq (
    trace_id      VARCHAR(64) NOT NULL PRIMARY KEY REFERENCES traces (trace_id) ON DELETE CASCADE,
    state         VARCHAR(16) NOT NULL CHECK (state IN ('waiting', 'exhausted')),
    attempts      BIGINT      NOT NULL,
    next_retry_at BIGINT,
    last_error    TEXT        NOT NULL,
    created_at    BIGINT      NOT NULL
);
CREATE INDEX trace_dlq_due ON trace_dlq (state, next_retry_at);
