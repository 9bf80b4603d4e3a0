-- The `tags` member of each version's definition (its JSON array text, else
-- NULL), written beside the definition by the application. The list filter
-- `?tag=` reads this column, not the definition: MariaDB's JSON functions
-- stop at 32 levels of nesting, so a filter on the definition missed deeper
-- ones; every backend reads the same column.
ALTER TABLE workflows ADD COLUMN tags TEXT;
ALTER TABLE channels ADD COLUMN tags TEXT;
UPDATE workflows SET tags = json_extract(definition, '$.tags') WHERE json_type(definition, '$.tags') = 'array';
UPDATE channels SET tags = json_extract(definition, '$.tags') WHERE json_type(definition, '$.tags') = 'array';
