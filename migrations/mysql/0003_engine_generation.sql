-- The fleet's engine generation: one row, bumped by every admin change that
-- reloads the engine, so every replica can tell whether it serves the
-- latest definitions (PostgreSQL also NOTIFYs on the bump; MySQL/MariaDB
-- replicas poll this row). Starts at 1: a fresh database serves generation 1.
CREATE TABLE engine_generation (
    id         INTEGER NOT NULL PRIMARY KEY,
    generation BIGINT  NOT NULL
);
INSERT INTO engine_generation (id, generation) VALUES (1, 1);
