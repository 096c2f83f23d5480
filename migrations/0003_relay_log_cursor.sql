-- The relay reads the event log itself instead of one outbox row per event.
--
-- Before: every event wrote an outbox row, and the relay updated (or deleted) each row after
-- its delivery report: two extra row writes per event, the relay's bottleneck. Now an event
-- that is publishable at commit is published straight from job_events, and the relay keeps
-- how far it got in one row (relay_cursor). Only delayed events (a scheduled retry's
-- RetryDue) still go through the outbox, which keeps their due time.
--
-- The log is read in (xid, seq) order, and only rows whose transaction id is below the
-- oldest transaction still running (pg_snapshot_xmin): those transactions have ended, and
-- any later commit has a higher xid, so the cursor never passes a row that commits later.
-- See docs/relay.md.

ALTER TABLE job_events
    -- The writing transaction. Rows from before this migration have 0.
    ADD COLUMN xid         xid8    NOT NULL DEFAULT '0',
    -- The Kafka key: the document id. NULL on rows written before this migration (the relay
    -- looks it up in jobs).
    ADD COLUMN key         text,
    -- Published through the outbox at its due time, not from the log at commit.
    ADD COLUMN delayed     boolean NOT NULL DEFAULT false,
    -- The event's W3C trace context, sent as Kafka headers. NULL: no trace.
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;
ALTER TABLE job_events ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

-- What the relay reads, in cursor order.
CREATE INDEX job_events_relay_idx ON job_events (xid, seq);

-- How far the relay has published the log: every event at or below (published_xid,
-- published_seq) that is not delayed reached Kafka. One row.
CREATE TABLE relay_cursor (
    id            boolean     NOT NULL DEFAULT true,
    published_xid xid8        NOT NULL,
    published_seq bigint      NOT NULL,
    moved_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT relay_cursor_pkey PRIMARY KEY (id),
    CONSTRAINT relay_cursor_one_row CHECK (id)
);

-- Existing rows keep their path: unpublished outbox rows stay in the outbox (and are marked
-- delayed so the log does not send them too); the log starts after the last existing event.
UPDATE job_events SET delayed = true
WHERE seq IN (SELECT seq FROM outbox WHERE published_at IS NULL);
INSERT INTO relay_cursor (published_xid, published_seq)
SELECT '0', coalesce(max(seq), 0) FROM job_events;

-- Wake the relay when events commit, as outbox inserts did (one notification per statement,
-- folded per transaction; delivered at commit).
CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
