-- The dedupe fact moves into the job row. `dispatch_version` is the stream version of the
-- dispatch event that leased the job's newest attempt, or that ended the job without one.
-- It is written by the lease transaction's own UPDATE of the job, so a redelivered
-- dispatch costs no lookup of its own, and a consumed one no row of its own.
--
-- A dispatch event older than it is skipped as a duplicate. Every dispatch event of a job
-- comes through one partition in stream order, so an older one arriving later was already
-- consumed (or was made stale by a newer one). The dispatch that leased the attempt, when
-- redelivered, meets the job's state as the `consumed_events` row found it: ended or
-- waiting for its retry (skipped), or leased (a live lease is waited for; an expired one is
-- taken over, as before).
ALTER TABLE jobs ADD COLUMN dispatch_version integer NOT NULL DEFAULT 0;

-- What the dedupe rows knew: the newest dispatch event each job consumed. (A job leased
-- now and not yet completed keeps an older one, and its state decides, as it did.)
UPDATE jobs j SET dispatch_version = d.stream_version
FROM (
    SELECT e.job_id, max(e.stream_version) AS stream_version
    FROM consumed_events c JOIN job_events e ON e.event_id = c.event_id
    GROUP BY e.job_id
) d
WHERE j.job_id = d.job_id;

DROP TABLE consumed_events;
DELETE FROM retention_cursor WHERE name = 'consumed_events';
ALTER TABLE retention_cursor DROP CONSTRAINT retention_cursor_name_is_known;
ALTER TABLE retention_cursor ADD CONSTRAINT retention_cursor_name_is_known
    CHECK (name IN ('job_events', 'job_results', 'jobs'));
