-- Definitions and audit details keep the text the application wrote. JSONB
-- normalised it: members came back sorted (shortest key first), `-0.0` as
-- `0.0`, so a definition read back differed from the one written, and from
-- what SQLite and MariaDB give back. JSON validates the text and keeps it.
-- Rows written before this migration keep JSONB's order (what was written
-- is gone); their digests, set from the text as written, are unchanged.
ALTER TABLE workflows ALTER COLUMN definition TYPE JSON USING CAST(definition AS JSON);
ALTER TABLE channels ALTER COLUMN definition TYPE JSON USING CAST(definition AS JSON);
ALTER TABLE connectors ALTER COLUMN definition TYPE JSON USING CAST(definition AS JSON);
ALTER TABLE audit_log ALTER COLUMN details TYPE JSON USING CAST(details AS JSON);
