-- Kinds an operator paused, for the whole group (`jobfold kinds pause`, `POST
-- /v1/kinds/{kind}/pause`). A processor passes over a dispatch of a paused kind without
-- leasing it: the job stays queued (or waiting to retry), its attempt unspent, and is noted
-- in `paused_dispatches`; resuming the kind dispatches those jobs again.
CREATE TABLE kind_pauses (
    kind       text        NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    paused_by  text        NOT NULL,
    reason     text,
    CONSTRAINT kind_pauses_pkey PRIMARY KEY (kind)
);

-- Every pause and resume: what, who, when, why. Append-only; retention leaves it alone.
CREATE TABLE kind_pause_log (
    id      bigint      GENERATED ALWAYS AS IDENTITY,
    kind    text        NOT NULL,
    action  text        NOT NULL,
    by_whom text        NOT NULL,
    reason  text,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT kind_pause_log_pkey PRIMARY KEY (id),
    CONSTRAINT kind_pause_log_action CHECK (action IN ('pause', 'resume'))
);
CREATE INDEX kind_pause_log_kind_idx ON kind_pause_log (kind, id);

-- Jobs whose dispatch a processor passed over because their kind was paused: written under
-- a share lock on the kind's pause row, so a resume (which deletes that row) either comes
-- first — and the dispatch runs — or waits for this row and dispatches it again. The
-- reaper dispatches what a resume left (its request cut short) once the kind runs.
CREATE TABLE paused_dispatches (
    job_id    uuid        NOT NULL,
    kind      text        NOT NULL,
    passed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT paused_dispatches_pkey PRIMARY KEY (job_id)
);
CREATE INDEX paused_dispatches_kind_idx ON paused_dispatches (kind, job_id);
