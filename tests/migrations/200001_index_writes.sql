-- The fault tests' oracle: every business write the test handler commits, WITHOUT a unique
-- constraint, so a duplicate effect shows as a second row for the same
-- (job_id, input_version).
CREATE TABLE index_writes (
    id            bigint      GENERATED ALWAYS AS IDENTITY,
    job_id        uuid        NOT NULL,
    document_id   text        NOT NULL,
    input_version bigint      NOT NULL,
    generation    bigint      NOT NULL,
    written_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT index_writes_pkey PRIMARY KEY (id)
);
CREATE INDEX index_writes_job_idx ON index_writes (job_id, input_version);
