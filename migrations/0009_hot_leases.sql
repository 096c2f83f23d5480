-- Unfinished jobs are found by `finished_at IS NULL` (the same set as the states queued,
-- leased and retry_wait: see jobs_finished_iff_final), not by an index on `state`. No index
-- then names a column that a lease, a heartbeat or a scheduled retry changes, so those
-- updates are heap-only (HOT): the new row version goes to the same page and no index gets
-- an entry for it. Pages keep room for that version.
DROP INDEX jobs_unfinished_idx;
CREATE INDEX jobs_unfinished_idx ON jobs (accepted_at) WHERE finished_at IS NULL;
ALTER TABLE jobs SET (fillfactor = 80);
