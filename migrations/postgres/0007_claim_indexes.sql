-- Indexes of the claimable traces alone, in the order claims read them
-- (`ORDER BY created_at, trace_id`). Over `traces_claim (status,
-- created_at)` a claim depended on the statistics: once they said most
-- traces were pending (a backlog, analysed before it drained), PostgreSQL
-- walked `traces_created` instead, filtering on the status, and read past
-- every trace finished since (17 ms per claim after 17,000), so a backlog
-- drained slower the further it got. A partial index holds only the rows a
-- claim wants, and its first entry is the answer. (`traces_claim` stays
-- for lists and counts by status.)
CREATE INDEX traces_pending ON traces (created_at, trace_id) WHERE status = 'pending';
CREATE INDEX traces_running ON traces (created_at, trace_id) WHERE status = 'running';
