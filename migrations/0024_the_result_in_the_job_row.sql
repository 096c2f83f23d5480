-- A job's result lives in its own row. A success updates the job row anyway (its state,
-- finished_at, generation); the result written with that update costs no row and no index
-- entry of its own, where `job_results` added a heap row and a primary-key entry a job.
-- The result is still in the log too (`JobSucceeded.result`), which is what replays read.
--
-- The results already committed move into their jobs' rows (one update of each succeeded
-- job that still has one: as long as retention keeps them), then the table goes.
ALTER TABLE jobs ADD COLUMN result jsonb;

UPDATE jobs j SET result = r.result
FROM job_results r
WHERE r.job_id = j.job_id AND r.input_version = j.input_version;

DROP TABLE job_results;
