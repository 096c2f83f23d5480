-- What the console shows of the last hours, kept per minute so that a page reads a few
-- hundred small rows whatever the job rate was.
--
-- kind_minutes: what each processor did with each kind in a minute, written by the
-- processor itself once the minute is over (one statement; on a graceful stop, the minute
-- so far). Times are histograms over fixed bounds (history::BOUNDS_MS, the last one open),
-- so processors' minutes add up.
CREATE TABLE kind_minutes (
    minute      timestamptz NOT NULL,
    kind        text        NOT NULL,
    owner       text        NOT NULL,
    -- Handler runs that ended (any outcome), and how the attempts and jobs ended.
    runs        integer     NOT NULL,
    succeeded   integer     NOT NULL,
    failed      integer     NOT NULL,
    quarantined integer     NOT NULL,
    superseded  integer     NOT NULL,
    cancelled   integer     NOT NULL,
    -- Acceptance (or due time) to a job's first start; a run's length.
    wait_ms     integer[]   NOT NULL,
    run_ms      integer[]   NOT NULL,
    CONSTRAINT kind_minutes_pkey PRIMARY KEY (minute, kind, owner)
);

-- overview_minutes: the overview's figures at each minute, written by the first processor
-- to get there: jobs accepted in the minute (a range of the primary key), and the gauges
-- (unfinished jobs, quarantined, the relay's backlog) as the minute ended.
CREATE TABLE overview_minutes (
    minute        timestamptz NOT NULL,
    accepted      bigint      NOT NULL,
    unfinished    bigint      NOT NULL,
    quarantined   bigint      NOT NULL,
    relay_backlog bigint      NOT NULL,
    CONSTRAINT overview_minutes_pkey PRIMARY KEY (minute)
);
