-- Each running processor's presence, for the console's Processors page: written by the
-- processor itself every few seconds (one row, one statement), deleted when it stops; a row
-- not written for an hour is deleted by the others. What it holds is a view, never a lock
-- or a lease: the job rows stay the only truth about who runs what.
CREATE TABLE processors (
    owner       text        NOT NULL,
    group_name  text        NOT NULL,
    version     text        NOT NULL,
    started_at  timestamptz NOT NULL,
    seen_at     timestamptz NOT NULL,
    partitions  integer[]   NOT NULL,
    in_flight   integer     NOT NULL,
    running     jsonb       NOT NULL,
    CONSTRAINT processors_pkey PRIMARY KEY (owner)
);
