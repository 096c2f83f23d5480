-- Operations: scheduled jobs, finding jobs, fixing dead letters.

-- When a scheduled job may first run (accept's `run_at`); NULL: at once. Its JobRequested
-- waits in the outbox until then, so no poller looks at it; the reaper counts a scheduled
-- job as stalled only `stall_after` past this time, not past its acceptance. Set at accept,
-- never changed.
ALTER TABLE jobs ADD COLUMN run_at timestamptz;

-- `GET /v1/jobs?kind=` in job_id (acceptance) order. kind never changes, so this index
-- costs one entry at accept and leaves leases heap-only updates (0009); nothing indexes
-- `state` for the same reason: unfinished states are found through jobs_unfinished_idx,
-- quarantined ones through the quarantine table.
CREATE INDEX jobs_kind_idx ON jobs (kind, job_id);

-- A dead letter sent back to the intake topic after its cause was fixed: when, how often.
-- Re-injecting twice is harmless (the intake's dedupe key is the request id).
ALTER TABLE dead_letters
    ADD COLUMN reinjected_at    timestamptz,
    ADD COLUMN reinjected_count integer NOT NULL DEFAULT 0;
