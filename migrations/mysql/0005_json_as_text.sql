-- JSON columns become plain LONGTEXT (the tables' utf8mb4_bin), without the
-- JSON_VALID checks: MariaDB's check refuses nesting past 31 levels, so a
-- definition, a payload or a result that any other backend keeps (an
-- else-if ladder of a dozen `if`s reaches it) was refused here. The
-- application writes only JSON it produced itself. On MySQL proper this also
-- stops the JSON type's normalisation (sorted members): text is kept as
-- written, as on the other backends.
--
-- The list filter `?tag=` reads a `tags` column (the definition's `tags`
-- array text, else NULL, written beside the definition) instead of
-- JSON_EXTRACT on the definition, which stops at the same 32 levels.
ALTER TABLE workflows MODIFY definition LONGTEXT NOT NULL, ADD COLUMN tags LONGTEXT NULL;
ALTER TABLE channels MODIFY definition LONGTEXT NOT NULL, ADD COLUMN tags LONGTEXT NULL;
UPDATE workflows SET tags = JSON_EXTRACT(definition, '$.tags') WHERE JSON_TYPE(JSON_EXTRACT(definition, '$.tags')) = 'ARRAY';
UPDATE channels SET tags = JSON_EXTRACT(definition, '$.tags') WHERE JSON_TYPE(JSON_EXTRACT(definition, '$.tags')) = 'ARRAY';
ALTER TABLE connectors MODIFY definition LONGTEXT NOT NULL;
ALTER TABLE audit_log MODIFY details LONGTEXT NOT NULL;
ALTER TABLE traces MODIFY payload LONGTEXT NOT NULL, MODIFY metadata LONGTEXT NOT NULL, MODIFY data LONGTEXT NULL, MODIFY errors LONGTEXT NOT NULL;
