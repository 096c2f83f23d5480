-- A NOTIFY serializes the commits that send one: each holds a database-wide lock from
-- before its commit record until the commit is flushed, so committing writers queue one
-- behind another and group commit ends. Writers now notify only when the relay sleeps.
--
-- The active relay holds advisory lock (1785684582, 1) exclusively while it sleeps until
-- notified (relay/src/lib.rs, SLEEP_LOCK). A writer that cannot take it shared notifies;
-- one that takes it holds it shared until it commits, so the relay cannot go to sleep before
-- that commit is visible to it, and reads it in the pass it makes after taking the lock.
-- While writers keep coming the relay stays awake and polls (2 to 50 ms); a relay of an
-- earlier version never takes the lock, so no writer notifies it and it polls at
-- `relay.poll_interval`.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1785684582, 1) THEN
        PERFORM pg_notify('jobfold_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;
