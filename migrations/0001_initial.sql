-- jobfold's tables. PostgreSQL is the authority: job_events is the append-only
-- log, jobs is its projection, outbox is what the relay still owes Kafka.
-- Constraint names are part of the interface: code matches on them.

CREATE TYPE job_state AS ENUM (
    'queued',       -- accepted, waiting for a lease
    'leased',       -- a worker holds it until lease_until (fenced by generation)
    'retry_wait',   -- failed retryably; a RetryDue outbox row is due at next_attempt_at
    'succeeded',    -- the one result for (job_id, input_version) is committed
    'quarantined',  -- invalid input, permanent failure or budget spent: an operator must act
    'superseded',   -- a newer input_version of the same document already succeeded
    'cancelled'
);

CREATE TABLE jobs (
    job_id          uuid        NOT NULL,
    document_id     text        NOT NULL,
    kind            text        NOT NULL,
    payload         jsonb       NOT NULL,
    input_version   bigint      NOT NULL,
    state           job_state   NOT NULL DEFAULT 'queued',
    attempt         integer     NOT NULL DEFAULT 0,
    generation      bigint      NOT NULL DEFAULT 0,
    lease_until     timestamptz,
    lease_owner     text,
    next_attempt_at timestamptz,
    accepted_at     timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    idempotency_key text,
    -- Budgets fixed at accept (or replay) time: no lease past max_attempts, no retry
    -- scheduled after the deadline.
    max_attempts    integer     NOT NULL,
    deadline        timestamptz,
    -- The last failure, for operators.
    last_error      text,
    -- Stream version of the last event appended for this job (0: none yet).
    stream_version  integer     NOT NULL DEFAULT 0,
    CONSTRAINT jobs_pkey PRIMARY KEY (job_id),
    CONSTRAINT jobs_idempotency_key_key UNIQUE (idempotency_key),
    CONSTRAINT jobs_input_version_is_positive CHECK (input_version > 0),
    CONSTRAINT jobs_attempt_is_non_negative CHECK (attempt >= 0),
    CONSTRAINT jobs_attempt_within_budget CHECK (attempt <= max_attempts),
    CONSTRAINT jobs_max_attempts_is_positive CHECK (max_attempts > 0),
    CONSTRAINT jobs_generation_is_non_negative CHECK (generation >= 0),
    CONSTRAINT jobs_leased_has_lease CHECK (
        state <> 'leased' OR (lease_until IS NOT NULL AND lease_owner IS NOT NULL)),
    CONSTRAINT jobs_finished_iff_final CHECK (
        (state IN ('succeeded', 'quarantined', 'superseded', 'cancelled')) = (finished_at IS NOT NULL))
);
CREATE INDEX jobs_document_id_idx ON jobs (document_id, input_version);
-- Unfinished work, for the gauges and the reaper: small because finished jobs leave it.
CREATE INDEX jobs_unfinished_idx ON jobs (state, accepted_at)
    WHERE state IN ('queued', 'leased', 'retry_wait');

CREATE TABLE job_events (
    seq            bigint      GENERATED ALWAYS AS IDENTITY,
    event_id       uuid        NOT NULL,
    job_id         uuid        NOT NULL,
    stream_version integer     NOT NULL,
    kind           text        NOT NULL,
    -- The event exactly as it travels on Kafka: Confluent wire format (magic, schema id, Avro body).
    body           bytea       NOT NULL,
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT job_events_pkey PRIMARY KEY (seq),
    CONSTRAINT job_events_event_id_key UNIQUE (event_id),
    -- Optimistic concurrency: a second writer of the same stream version loses.
    CONSTRAINT job_events_stream_version_key UNIQUE (job_id, stream_version),
    CONSTRAINT job_events_stream_version_is_positive CHECK (stream_version > 0),
    CONSTRAINT job_events_job_id_fkey FOREIGN KEY (job_id) REFERENCES jobs (job_id)
);

CREATE TABLE outbox (
    seq          bigint      NOT NULL,
    topic        text        NOT NULL,
    key          text        NOT NULL,
    -- When the row may be published: its insert (clock time, not the transaction's start),
    -- or a scheduled retry's due time.
    available_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at timestamptz,
    CONSTRAINT outbox_pkey PRIMARY KEY (seq),
    CONSTRAINT outbox_seq_fkey FOREIGN KEY (seq) REFERENCES job_events (seq)
);
-- What the relay claims: unpublished rows in log order (it skips the few not yet due).
CREATE INDEX outbox_unpublished_idx ON outbox (seq) WHERE published_at IS NULL;
-- When the next delayed row (a scheduled retry) becomes due.
CREATE INDEX outbox_due_idx ON outbox (available_at) WHERE published_at IS NULL;
-- What pruning scans.
CREATE INDEX outbox_published_idx ON outbox (published_at) WHERE published_at IS NOT NULL;

-- Wakes the relay when an outbox row commits (NOTIFY is delivered at commit, so a relay
-- never hears of a row it cannot see yet). One notification per statement, and Postgres
-- folds identical notifications of one transaction into one.
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('jobfold_outbox', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();

CREATE TABLE job_results (
    job_id        uuid        NOT NULL,
    input_version bigint      NOT NULL,
    generation    bigint      NOT NULL,
    result        jsonb       NOT NULL,
    committed_at  timestamptz NOT NULL DEFAULT now(),
    -- The one committed result per (job, input version).
    CONSTRAINT job_results_pkey PRIMARY KEY (job_id, input_version),
    CONSTRAINT job_results_job_id_fkey FOREIGN KEY (job_id) REFERENCES jobs (job_id)
);

-- The example business output: written only WHERE version < input_version.
CREATE TABLE document_index (
    document_id text        NOT NULL,
    version     bigint      NOT NULL,
    output      jsonb       NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT document_index_pkey PRIMARY KEY (document_id)
);

-- Every business write the example handler commits, WITHOUT a unique constraint: a
-- duplicate effect would show here as a second row for the same (job_id, input_version).
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

-- Dedupe rows. Do not change the key: (consumer_group, event_id) is what makes a
-- redelivered event a no-op; a different key lets duplicates through.
CREATE TABLE consumed_events (
    consumer_group text        NOT NULL,
    event_id       uuid        NOT NULL,
    topic          text        NOT NULL,
    kafka_partition integer    NOT NULL,
    kafka_offset   bigint      NOT NULL,
    consumed_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT consumed_events_pkey PRIMARY KEY (consumer_group, event_id)
);

CREATE TABLE partition_offsets (
    consumer_group  text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    -- The next offset to process: everything below it is committed here.
    next_offset     bigint      NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT partition_offsets_pkey PRIMARY KEY (consumer_group, topic, kafka_partition),
    CONSTRAINT partition_offsets_next_offset_is_non_negative CHECK (next_offset >= 0)
);

CREATE TABLE quarantine (
    job_id         uuid        NOT NULL,
    reason         text        NOT NULL,
    error_class    text        NOT NULL,
    input_version  bigint      NOT NULL,
    last_attempt_at timestamptz,
    attempts       integer     NOT NULL,
    -- Who must act: a team or service name taken from the job kind's configuration.
    owner          text        NOT NULL,
    quarantined_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT quarantine_pkey PRIMARY KEY (job_id),
    CONSTRAINT quarantine_job_id_fkey FOREIGN KEY (job_id) REFERENCES jobs (job_id)
);
CREATE INDEX quarantine_owner_idx ON quarantine (owner, quarantined_at);

-- Undecodable or poison messages: kept with their coordinates, never blocking a partition.
CREATE TABLE dead_letters (
    id              bigint      GENERATED ALWAYS AS IDENTITY,
    consumer_group  text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    raw_key         bytea,
    raw_value       bytea,
    error           text        NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT dead_letters_pkey PRIMARY KEY (id),
    -- A redelivered poison message is recorded once.
    CONSTRAINT dead_letters_coordinates_key UNIQUE (consumer_group, topic, kafka_partition, kafka_offset)
);
