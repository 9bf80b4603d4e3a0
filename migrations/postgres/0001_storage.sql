-- Sluice storage schema for PostgreSQL: versioned workflows and channels, connectors,
-- the audit log and a lock table. Definitions are JSONB; timestamps are microseconds
-- since the Unix epoch (BIGINT) so ordering is the same on every backend.

CREATE TABLE workflows (
    id                 VARCHAR(128) NOT NULL,
    version            BIGINT       NOT NULL CHECK (version >= 1),
    status             VARCHAR(16)  NOT NULL CHECK (status IN ('draft', 'active', 'archived', 'paused')),
    rollout_percentage BIGINT       NOT NULL DEFAULT 100 CHECK (rollout_percentage BETWEEN 1 AND 100),
    name               TEXT         NOT NULL,
    channel_type       TEXT,
    protocol           TEXT,
    definition         JSONB        NOT NULL,
    created_at         BIGINT       NOT NULL,
    updated_at         BIGINT       NOT NULL,
    PRIMARY KEY (id, version)
);
-- At most one draft per workflow, whatever races the application loses.
CREATE UNIQUE INDEX workflows_one_draft ON workflows (id) WHERE status = 'draft';
CREATE INDEX workflows_status ON workflows (status);
CREATE INDEX workflows_created ON workflows (created_at, id);

CREATE TABLE channels (
    id                 VARCHAR(128) NOT NULL,
    version            BIGINT       NOT NULL CHECK (version >= 1),
    status             VARCHAR(16)  NOT NULL CHECK (status IN ('draft', 'active', 'archived', 'paused')),
    rollout_percentage BIGINT       NOT NULL DEFAULT 100 CHECK (rollout_percentage BETWEEN 1 AND 100),
    name               TEXT         NOT NULL,
    channel_type       TEXT,
    protocol           TEXT,
    definition         JSONB        NOT NULL,
    created_at         BIGINT       NOT NULL,
    updated_at         BIGINT       NOT NULL,
    PRIMARY KEY (id, version)
);
CREATE UNIQUE INDEX channels_one_draft ON channels (id) WHERE status = 'draft';
CREATE INDEX channels_status ON channels (status);
CREATE INDEX channels_created ON channels (created_at, id);
CREATE INDEX channels_name ON channels (name);

CREATE TABLE connectors (
    name           VARCHAR(255) NOT NULL PRIMARY KEY,
    connector_type VARCHAR(64)  NOT NULL,
    definition     JSONB        NOT NULL,
    created_at     BIGINT       NOT NULL,
    updated_at     BIGINT       NOT NULL
);
CREATE INDEX connectors_created ON connectors (created_at, name);

CREATE TABLE audit_log (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    principal     VARCHAR(32)  NOT NULL,
    action        VARCHAR(32)  NOT NULL,
    resource_type VARCHAR(32)  NOT NULL,
    resource_id   VARCHAR(255) NOT NULL,
    version       BIGINT,
    details       JSONB        NOT NULL,
    created_at    BIGINT       NOT NULL
);
CREATE INDEX audit_log_action ON audit_log (action);
CREATE INDEX audit_log_resource_type ON audit_log (resource_type);

-- Rows locked with SELECT ... FOR UPDATE to serialise changes that span ids
-- (a channel name must be unique across channel ids).
CREATE TABLE storage_locks (
    name VARCHAR(64) NOT NULL PRIMARY KEY
);
INSERT INTO storage_locks (name) VALUES ('channel_names');
