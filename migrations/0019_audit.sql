-- Every change an operator made through the HTTP API or the CLI: who (the API token's name,
-- or the operating-system user of the CLI's direct database path), what, when, on what,
-- and the request's id. Append-only; retention leaves it alone. A change to one job writes
-- its row in the change's own transaction; a bulk change and a kind's pause write theirs
-- once done.
CREATE TABLE audit_log (
    id         bigint      GENERATED ALWAYS AS IDENTITY,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor      text        NOT NULL,
    role       text,
    via        text        NOT NULL,
    action     text        NOT NULL,
    target     text,
    request_id text,
    detail     jsonb       NOT NULL DEFAULT '{}',
    CONSTRAINT audit_log_pkey PRIMARY KEY (id),
    CONSTRAINT audit_log_via CHECK (via IN ('api', 'cli'))
);
CREATE INDEX audit_log_at_idx ON audit_log (at);
