-- Sluice storage schema for SQLite: versioned workflows and channels, connectors,
-- the audit log and a lock table kept for parity with the server backends.
-- Definitions are JSON text guarded by json_valid; timestamps are microseconds
-- since the Unix epoch (INTEGER) so ordering is the same on every backend.

CREATE TABLE workflows (
    id                 TEXT    NOT NULL,
    version            INTEGER NOT NULL CHECK (version >= 1),
    status             TEXT    NOT NULL CHECK (status IN ('draft', 'active', 'archived', 'paused')),
    rollout_percentage INTEGER NOT NULL DEFAULT 100 CHECK (rollout_percentage BETWEEN 1 AND 100),
    name               TEXT    NOT NULL,
    channel_type       TEXT,
    protocol           TEXT,
    definition         TEXT    NOT NULL CHECK (json_valid(definition)),
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    PRIMARY KEY (id, version)
);
-- At most one draft per workflow, whatever races the application loses.
CREATE UNIQUE INDEX workflows_one_draft ON workflows (id) WHERE status = 'draft';
CREATE INDEX workflows_status ON workflows (status);
CREATE INDEX workflows_created ON workflows (created_at, id);

CREATE TABLE channels (
    id                 TEXT    NOT NULL,
    version            INTEGER NOT NULL CHECK (version >= 1),
    status             TEXT    NOT NULL CHECK (status IN ('draft', 'active', 'archived', 'paused')),
    rollout_percentage INTEGER NOT NULL DEFAULT 100 CHECK (rollout_percentage BETWEEN 1 AND 100),
    name               TEXT    NOT NULL,
    channel_type       TEXT,
    protocol           TEXT,
    definition         TEXT    NOT NULL CHECK (json_valid(definition)),
    created_at         INTEGER NOT NULL,
    updated_at         INTEGER NOT NULL,
    PRIMARY KEY (id, version)
);
CREATE UNIQUE INDEX channels_one_draft ON channels (id) WHERE status = 'draft';
CREATE INDEX channels_status ON channels (status);
CREATE INDEX channels_created ON channels (created_at, id);
CREATE INDEX channels_name ON channels (name);

CREATE TABLE connectors (
    name           TEXT    NOT NULL PRIMARY KEY,
    connector_type TEXT    NOT NULL,
    definition     TEXT    NOT NULL CHECK (json_valid(definition)),
    created_at     INTEGER NOT NULL,
    updated_at     INTEGER NOT NULL
);
CREATE INDEX connectors_created ON connectors (created_at, name);

CREATE TABLE audit_log (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    principal     TEXT    NOT NULL,
    action        TEXT    NOT NULL,
    resource_type TEXT    NOT NULL,
    resource_id   TEXT    NOT NULL,
    version       INTEGER,
    details       TEXT    NOT NULL CHECK (json_valid(details)),
    created_at    INTEGER NOT NULL
);
CREATE INDEX audit_log_action ON audit_log (action);
CREATE INDEX audit_log_resource_type ON audit_log (resource_type);

-- Rows locked with SELECT ... FOR UPDATE on PostgreSQL/MariaDB to serialise
-- changes that span ids (channel names). SQLite serialises writers with
-- BEGIN IMMEDIATE instead, but keeps the table so the schemas match.
CREATE TABLE storage_locks (
    name TEXT NOT NULL PRIMARY KEY
);
INSERT INTO storage_locks (name) VALUES ('channel_names');
