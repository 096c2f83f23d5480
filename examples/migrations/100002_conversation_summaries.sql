-- summarize-conversation's business output: the latest summary of each conversation (the
-- job's document), written only over an older version.
CREATE TABLE conversation_summaries (
    conversation_id text        NOT NULL,
    version         bigint      NOT NULL,
    summary         text        NOT NULL,
    model           text        NOT NULL,
    job_id          uuid        NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT conversation_summaries_pkey PRIMARY KEY (conversation_id)
);
