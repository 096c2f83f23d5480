-- A job's events reach Kafka in stream order even when one of them waits in the outbox.
--
-- A delayed event (a scheduled retry's RetryDue) waits in the outbox for its due time while
-- later events go straight from the log. Should a later event of the same job be written
-- before the delayed one is published, the later one would reach Kafka first. So an append
-- first looks for the job's unpublished outbox rows: if there are any, the new event goes
-- through the outbox behind them, and they are made due no later than it. This index makes
-- that look one probe per append.
CREATE INDEX outbox_pending_key_idx ON outbox (key) WHERE published_at IS NULL;
