-- Fewer index entries a job. Every job writes three events and its row twice (at accept,
-- and at completion, which is not heap-only: finished_at moves it between the partial
-- indexes), and each write pays an entry in every index it qualifies for.
--
-- The event id was unique by constraint, an index entry for each event that no statement
-- reads: ids are UUIDv7s drawn by their writer, and the log's real fence against a second
-- writer is (job_id, stream_version). Consumers that deduplicate by event id still can.
ALTER TABLE job_events DROP CONSTRAINT job_events_event_id_key;

-- The idempotency key stays unique, under the same name, but only jobs that have one are
-- in its index: a job accepted without a key no longer adds a NULL entry at accept and
-- another at completion. Accepts name the predicate in their ON CONFLICT clause.
ALTER TABLE jobs DROP CONSTRAINT jobs_idempotency_key_key;
CREATE UNIQUE INDEX jobs_idempotency_key_key ON jobs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
