-- The supersede check (the newest succeeded version of a document, per kind) and retention
-- look jobs up by document and kind. With only (document_id, input_version) and
-- (kind, job_id) to choose from, a kind that was new since the last ANALYZE looked rare, the
-- planner took jobs_kind_idx, and every check walked all jobs of that kind for each document
-- it asked about: 23 ms a call, Postgres's CPU per job eight times its usual, in the first
-- 50,000-job burst of a new kind. An index on both leaves no such choice.
CREATE INDEX jobs_document_kind_idx ON jobs (document_id, kind, input_version);
DROP INDEX jobs_document_id_idx;
