-- The kinds some processor has a handler for: each processor registers its kinds at start.
-- Accept refuses a kind that is not here (unless accept.any_kind), so a misspelt kind fails
-- at once instead of waiting for a handler that never comes.
CREATE TABLE job_kinds (
    kind               text        NOT NULL,
    first_registered   timestamptz NOT NULL DEFAULT now(),
    last_registered    timestamptz NOT NULL DEFAULT now(),
    -- The processor that registered it last (`host/pid`).
    registered_by      text        NOT NULL,
    CONSTRAINT job_kinds_pkey PRIMARY KEY (kind)
);
