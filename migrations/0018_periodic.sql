-- Periodic jobs (`[periodic.<name>]`): one job per tick of a schedule, accepted by whichever
-- processor holds the group's schedule lease.

-- The lease: one row, held by one processor (`host/pid`) until `lease_until`, renewed while
-- it runs, taken by another once it runs out (its holder died) or is given back (a stop).
CREATE TABLE periodic_leader (
    id          int         NOT NULL DEFAULT 1,
    holder      text        NOT NULL,
    lease_until timestamptz NOT NULL,
    since       timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT periodic_leader_pkey PRIMARY KEY (id),
    CONSTRAINT periodic_leader_one_row CHECK (id = 1)
);

-- Per schedule: the newest tick that has its job (or was passed: skipped, refused), locked
-- while a tick's job is accepted, so each tick is decided once whoever holds the lease. The
-- job's idempotency key is the tick too: even two holders at once could not make two.
CREATE TABLE periodic_schedules (
    name        text        NOT NULL,
    last_tick   timestamptz NOT NULL,
    last_job_id uuid,
    last_error  text,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT periodic_schedules_pkey PRIMARY KEY (name)
);
