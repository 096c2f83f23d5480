-- How the attempt before the next one ended, as that attempt is told (the handler's
-- JobContext::previous_outcome, the remote request's "previous_outcome"): null when no
-- attempt failed at this input version since its last success, 'failed' when the last one
-- failed with a definite answer, 'ambiguous' when its effects may have happened (it timed
-- out or lost its connection after sending, panicked, lost its lease, died with its
-- process). The fold of JobFailed.outcome_unknown; a handler calling an outside service
-- looks its idempotency key up there before acting again after 'ambiguous'.
ALTER TABLE jobs ADD COLUMN previous_outcome text
    CONSTRAINT jobs_previous_outcome_is_known CHECK (previous_outcome IN ('failed', 'ambiguous'));

-- Attempts that a handler over HTTP accepted with 202 and completes by calling back
-- (POST /v1/jobs/{id}/heartbeat and /complete). One row a job, for its current attempt,
-- written by the processor holding the lease when the 202 arrives and deleted when that
-- attempt ends. The callbacks write it, fenced: only while the job is leased at this
-- generation. The processor holding the lease reads the outcome and commits it with its
-- own generation check, as it commits any attempt: a callback never writes the job.
CREATE TABLE async_attempts (
    job_id       uuid        NOT NULL,
    generation   bigint      NOT NULL,
    -- The processor waiting for it (its lease owner).
    owner        text        NOT NULL,
    accepted_at  timestamptz NOT NULL DEFAULT now(),
    -- The handler's last heartbeat (the 202 counts as the first), and what it reported.
    beat_at      timestamptz NOT NULL DEFAULT now(),
    progress     jsonb,
    -- The handler's answer, as a synchronous call would have given it: {"status": 200,
    -- "result": …} or {"status": 422|429|5xx|…, "error": "…", "retry_after": seconds}.
    outcome      jsonb,
    completed_at timestamptz,
    CONSTRAINT async_attempts_pkey PRIMARY KEY (job_id)
);
