-- index-document's business output: one row per document, written only over an older
-- version (the conditional write in examples/src/index.rs).
CREATE TABLE document_index (
    document_id text        NOT NULL,
    version     bigint      NOT NULL,
    output      jsonb       NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT document_index_pkey PRIMARY KEY (document_id)
);
