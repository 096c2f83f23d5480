-- Events and results name their job without a foreign key. Each key check was a query of
-- its own per inserted row, which also locked the job row (FOR KEY SHARE): measured on
-- INSERT … SELECT of 20,000 rows, 6.7–7.7 µs a row with the key, 1.6 without, and a job
-- writes four such rows (three events, one result). What the key guarded holds by
-- construction: a job's first event is inserted in the statement that inserts the job, every
-- later event and the result in a transaction that holds the job row locked (FOR UPDATE),
-- and retention deletes a job's events and result before the job (processor/src/retention.rs).
-- The quarantine and outbox keys stay: they are off the hot path.
ALTER TABLE job_events DROP CONSTRAINT job_events_job_id_fkey;
ALTER TABLE job_results DROP CONSTRAINT job_results_job_id_fkey;
