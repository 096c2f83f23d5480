-- convert-audio's business output: where each document's converted audio is and its
-- SHA-256, written only over an older version.
CREATE TABLE audio_conversions (
    document_id text        NOT NULL,
    version     bigint      NOT NULL,
    path        text        NOT NULL,
    sha256      text        NOT NULL,
    bytes       bigint      NOT NULL,
    job_id      uuid        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT audio_conversions_pkey PRIMARY KEY (document_id)
);
