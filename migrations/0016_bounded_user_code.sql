-- What user code can cost is bounded: a job snoozed without spending attempts, and a run
-- that killed its processor, are counted; no pause a kind was given lasts past the cap.

-- Per job, what is counted outside its attempts (rare paths only: a row appears at a job's
-- first snooze or crash). Deleted with the job (retention) and on an operator's replay.
CREATE TABLE job_counters (
    job_id uuid NOT NULL,
    -- Snoozes taken without spending an attempt (`processor.max_snoozes`).
    snoozes int NOT NULL DEFAULT 0,
    -- Processes that died while the job ran (`processor.max_crashes`).
    crashes int NOT NULL DEFAULT 0,
    last_crash_owner text,
    last_crash_at timestamptz,
    CONSTRAINT job_counters_pkey PRIMARY KEY (job_id)
);

-- Runs a lease transaction started before it commits (its inline window), recorded in a
-- commit of their own before they start and deleted by the transaction that commits them.
-- A row left behind belongs to a transaction that never committed: its process died while
-- these jobs ran (or before they did), and whoever leases one of them next counts that as
-- the job's attempt and crash.
CREATE TABLE inline_runs (
    run_id uuid NOT NULL,
    job_ids uuid[] NOT NULL,
    owner text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT inline_runs_pkey PRIMARY KEY (run_id)
);

-- A throttled kind's rates grow back from the end of its pause, not from the 429: while it
-- is paused, the factor the table holds is the factor in force (and the gauge says so).
CREATE OR REPLACE FUNCTION kind_quota_factor(q kind_quotas, at timestamptz, recover_secs float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
    SELECT least(1.0, q.factor + greatest(0, extract(epoch FROM
        at - greatest(q.throttled_at, q.paused_until))) / recover_secs)
$$;

-- No pause past the default `processor.max_retry_after` survives from before it was capped
-- (a `Retry-After` of 99999999999 seconds had paused a kind until the year 5195).
UPDATE kind_quotas SET paused_until = least(paused_until, now() + interval '10 minutes')
WHERE paused_until > now() + interval '10 minutes';
