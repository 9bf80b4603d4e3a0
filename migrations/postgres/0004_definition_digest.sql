-- A digest of each version's definition (hex SHA-256 of the text the
-- application wrote), set by every write of a definition and copied with it
-- to a new version. An engine reload reads (id, version, timestamps, digest)
-- of the active rows and fetches the full text only of the rows whose digest
-- or updated_at differ from what its current snapshot was built from.
-- NULL (rows written before this migration, until `Store::migrate` fills
-- them in) never matches: such a row's text is always fetched.
ALTER TABLE workflows ADD COLUMN digest TEXT;
ALTER TABLE channels ADD COLUMN digest TEXT;
