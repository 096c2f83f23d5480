-- The W3C trace context of each outbox row's event, so the relay can send it as Kafka
-- headers (`traceparent`, `tracestate`) without decoding the Avro body. NULL: no trace.
ALTER TABLE outbox
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;
