-- Events the relay cannot produce are parked, not retried in place.
--
-- Before: an event the broker or librdkafka refused (larger than the topic's
-- max.message.bytes, say) held the relay's cursor just before it, and every pass sent every
-- later event of every document again: the topic filled with copies while nothing moved. Now
-- an event refused for what it is (its size, its bytes) is parked here and the cursor moves
-- on; the later events of its document wait here behind it, in order, and every other
-- document flows. An operator retries (after raising the topic's limit) or drops the refused
-- event with `jobfold parked`; then its document's waiting events follow, in order.

CREATE TABLE relay_parked (
    -- The event (job_events.seq); its body stays in job_events.
    seq                bigint      NOT NULL,
    topic              text        NOT NULL,
    -- The document id: the Kafka key.
    key                text        NOT NULL,
    -- true: Kafka refused this event itself; false: it waits behind a refused event of its
    -- document.
    refused            boolean     NOT NULL,
    reason             text        NOT NULL,
    parked_at          timestamptz NOT NULL DEFAULT now(),
    -- Set by `jobfold parked retry`: the relay sends the document's parked events again.
    retry_requested_at timestamptz,
    -- How often the relay has tried to produce it.
    attempts           integer     NOT NULL DEFAULT 1,
    CONSTRAINT relay_parked_pkey PRIMARY KEY (seq),
    CONSTRAINT relay_parked_retry_only_refused CHECK (refused OR retry_requested_at IS NULL)
);

-- A document's parked events, in the order they go out.
CREATE INDEX relay_parked_key_idx ON relay_parked (key, seq);

-- Wake the relay when an operator asks for a retry or drops an event.
CREATE TRIGGER relay_parked_notify AFTER UPDATE OR DELETE ON relay_parked
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
