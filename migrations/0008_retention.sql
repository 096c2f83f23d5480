-- `partition_offsets` was written in every lease and completion transaction and read by
-- nothing: Kafka's committed offsets and the dedupe rows are what resume a partition. It
-- goes, and with it a hot row every batch upserted.
DROP TABLE partition_offsets;

-- Dedupe rows name their job, so the rows of ended jobs can be deleted by retention.
ALTER TABLE consumed_events ADD COLUMN job_id uuid;
UPDATE consumed_events c SET job_id = e.job_id FROM job_events e WHERE e.event_id = c.event_id;
CREATE INDEX consumed_events_job_idx ON consumed_events (job_id);

-- Ended jobs in the order they ended, for the retention sweeps.
CREATE INDEX jobs_finished_idx ON jobs (finished_at, job_id) WHERE finished_at IS NOT NULL;

-- How far each retention sweep got through the ended jobs (finished_at, job_id). A sweep
-- locks its row, so processors sweeping at once take turns.
CREATE TABLE retention_cursor (
    name          text        NOT NULL,
    finished_at   timestamptz NOT NULL DEFAULT '1970-01-01 00:00:00+00',
    job_id        uuid        NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000',
    swept_at      timestamptz,
    CONSTRAINT retention_cursor_pkey PRIMARY KEY (name),
    CONSTRAINT retention_cursor_name_is_known
        CHECK (name IN ('consumed_events', 'job_events', 'job_results', 'jobs'))
);
INSERT INTO retention_cursor (name)
VALUES ('consumed_events'), ('job_events'), ('job_results'), ('jobs');
