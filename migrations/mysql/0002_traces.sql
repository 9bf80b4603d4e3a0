-- Async traces and their dead-letter queue (MariaDB/MySQL). JSON columns are
-- LONGTEXT with a JSON_VALID check, kept byte for byte as written. Timestamps
-- are microseconds since the Unix epoch, as in 0001; utf8mb4_bin as in 0001.

CREATE TABLE traces (
    trace_id         VARCHAR(64)  NOT NULL,
    channel          VARCHAR(255) NOT NULL,
    mode             VARCHAR(16)  NOT NULL,
    status           VARCHAR(16)  NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'failed')),
    workflow_id      VARCHAR(128),
    workflow_version BIGINT,
    -- The rollout bucket of the submitting request: its inputs (authorization,
    -- client IP) are not stored, so the bucket is fixed at submission.
    bucket           BIGINT,
    payload          LONGTEXT     NOT NULL CHECK (JSON_VALID(payload)),
    metadata         LONGTEXT     NOT NULL CHECK (JSON_VALID(metadata)),
    data             LONGTEXT     CHECK (data IS NULL OR JSON_VALID(data)),
    errors           LONGTEXT     NOT NULL CHECK (JSON_VALID(errors)),
    -- Runs started so far; also the fencing token of the current run.
    attempts         BIGINT       NOT NULL DEFAULT 0,
    created_at       BIGINT       NOT NULL,
    started_at       BIGINT,
    completed_at     BIGINT,
    duration_ms      DOUBLE,
    -- A running trace whose lease has passed is claimable again (crashed worker).
    lease_until      BIGINT,
    PRIMARY KEY (trace_id),
    KEY traces_claim (status, created_at),
    KEY traces_created (created_at, trace_id),
    KEY traces_channel (channel)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE trace_dlq (
    trace_id      VARCHAR(64) NOT NULL,
    state         VARCHAR(16) NOT NULL CHECK (state IN ('waiting', 'exhausted')),
    attempts      BIGINT      NOT NULL,
    next_retry_at BIGINT,
    last_error    LONGTEXT    NOT NULL,
    created_at    BIGINT      NOT NULL,
    PRIMARY KEY (trace_id),
    KEY trace_dlq_due (state, next_retry_at),
    CONSTRAINT trace_dlq_trace FOREIGN KEY (trace_id) REFERENCES traces (trace_id) ON DELETE CASCADE
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
