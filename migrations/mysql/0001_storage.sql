-- Sluice storage schema for MariaDB/MySQL: versioned workflows and channels,
-- connectors, the audit log and a lock table. Definitions are JSON (LONGTEXT with
-- a JSON_VALID check on MariaDB); timestamps are microseconds since the Unix epoch
-- (BIGINT). utf8mb4_bin keeps ids and names case-sensitive, as on the other backends.
-- MariaDB has no partial indexes, so "one draft per id" is a UNIQUE index on a
-- STORED generated column that is NULL except for drafts.

CREATE TABLE workflows (
    id                 VARCHAR(128) NOT NULL,
    version            BIGINT       NOT NULL CHECK (version >= 1),
    status             VARCHAR(16)  NOT NULL CHECK (status IN ('draft', 'active', 'archived', 'paused')),
    rollout_percentage BIGINT       NOT NULL DEFAULT 100 CHECK (rollout_percentage BETWEEN 1 AND 100),
    name               VARCHAR(255) NOT NULL,
    channel_type       VARCHAR(64),
    protocol           VARCHAR(64),
    definition         JSON         NOT NULL,
    created_at         BIGINT       NOT NULL,
    updated_at         BIGINT       NOT NULL,
    draft_of           VARCHAR(128) AS (CASE WHEN status = 'draft' THEN id END) STORED,
    PRIMARY KEY (id, version),
    UNIQUE KEY workflows_one_draft (draft_of),
    KEY workflows_status (status),
    KEY workflows_created (created_at, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE channels (
    id                 VARCHAR(128) NOT NULL,
    version            BIGINT       NOT NULL CHECK (version >= 1),
    status             VARCHAR(16)  NOT NULL CHECK (status IN ('draft', 'active', 'archived', 'paused')),
    rollout_percentage BIGINT       NOT NULL DEFAULT 100 CHECK (rollout_percentage BETWEEN 1 AND 100),
    name               VARCHAR(255) NOT NULL,
    channel_type       VARCHAR(64),
    protocol           VARCHAR(64),
    definition         JSON         NOT NULL,
    created_at         BIGINT       NOT NULL,
    updated_at         BIGINT       NOT NULL,
    draft_of           VARCHAR(128) AS (CASE WHEN status = 'draft' THEN id END) STORED,
    PRIMARY KEY (id, version),
    UNIQUE KEY channels_one_draft (draft_of),
    KEY channels_status (status),
    KEY channels_created (created_at, id),
    KEY channels_name (name)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE connectors (
    name           VARCHAR(255) NOT NULL PRIMARY KEY,
    connector_type VARCHAR(64)  NOT NULL,
    definition     JSON         NOT NULL,
    created_at     BIGINT       NOT NULL,
    updated_at     BIGINT       NOT NULL,
    KEY connectors_created (created_at, name)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE audit_log (
    id            BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    principal     VARCHAR(32)  NOT NULL,
    action        VARCHAR(32)  NOT NULL,
    resource_type VARCHAR(32)  NOT NULL,
    resource_id   VARCHAR(255) NOT NULL,
    version       BIGINT,
    details       JSON         NOT NULL,
    created_at    BIGINT       NOT NULL,
    KEY audit_log_action (action),
    KEY audit_log_resource_type (resource_type)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Rows locked with SELECT ... FOR UPDATE to serialise changes that span ids
-- (a channel name must be unique across channel ids).
CREATE TABLE storage_locks (
    name VARCHAR(64) NOT NULL PRIMARY KEY
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
INSERT INTO storage_locks (name) VALUES ('channel_names');
