-- Provider quotas, shared by every processor of a group: one row per kind that has a rate
-- limit (`[kinds.<kind>] rate_per_second`, `cost_per_minute`) or was throttled (a 429).
--
-- Two token buckets per kind: requests (one per attempt) and cost (the units a handler
-- declares per job, such as a model's tokens). A bucket holds at most one second's
-- requests and one minute's cost; it refills at the configured rate times `factor`.
-- After a throttled attempt (429) the kind waits until `paused_until` and its factor
-- halves (at most once a second, not below 1/16); it grows back linearly to 1 over the
-- recovery time given by the caller.
CREATE TABLE kind_quotas (
    kind          text             NOT NULL,
    requests      double precision NOT NULL,
    cost          double precision NOT NULL,
    refilled_at   timestamptz      NOT NULL DEFAULT clock_timestamp(),
    paused_until  timestamptz      NOT NULL DEFAULT '2000-01-01Z',
    factor        double precision NOT NULL DEFAULT 1,
    throttled_at  timestamptz      NOT NULL DEFAULT '2000-01-01Z',
    throttles     bigint           NOT NULL DEFAULT 0,
    CONSTRAINT kind_quotas_pkey PRIMARY KEY (kind),
    CONSTRAINT kind_quotas_factor_in_range CHECK (factor > 0 AND factor <= 1)
);

-- The factor a kind's rates are multiplied by at `at`: its last one, grown back since.
CREATE FUNCTION kind_quota_factor(q kind_quotas, at timestamptz, recover_secs float8)
RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
    SELECT least(1.0, q.factor + greatest(0, extract(epoch FROM at - q.throttled_at)) / recover_secs)
$$;

-- Takes `requests` and `cost` from `kind`'s buckets (capacities and rates per second as
-- this processor is configured; a bucket with rate 0 is not limited) and returns 0, or
-- takes nothing and returns the seconds until it could. One statement, one row lock.
CREATE FUNCTION take_kind_quota(
    p_kind text, p_requests float8, p_cost float8,
    p_requests_cap float8, p_requests_rate float8,
    p_cost_cap float8, p_cost_rate float8, p_recover_secs float8
) RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    q kind_quotas;
    at timestamptz := clock_timestamp();
    f float8;
    elapsed float8;
    r float8;
    c float8;
    wait float8 := 0;
BEGIN
    SELECT * INTO q FROM kind_quotas WHERE kind = p_kind FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO kind_quotas (kind, requests, cost, refilled_at)
        VALUES (p_kind, p_requests_cap, p_cost_cap, at) ON CONFLICT (kind) DO NOTHING;
        SELECT * INTO q FROM kind_quotas WHERE kind = p_kind FOR UPDATE;
    END IF;
    f := kind_quota_factor(q, at, p_recover_secs);
    elapsed := greatest(0, extract(epoch FROM at - q.refilled_at));
    r := least(p_requests_cap, q.requests + elapsed * p_requests_rate * f);
    c := least(p_cost_cap, q.cost + elapsed * p_cost_rate * f);
    IF q.paused_until > at THEN
        wait := extract(epoch FROM q.paused_until - at);
    END IF;
    IF p_requests_rate > 0 AND r < p_requests THEN
        wait := greatest(wait, (p_requests - r) / (p_requests_rate * f));
    END IF;
    IF p_cost_rate > 0 AND c < p_cost THEN
        wait := greatest(wait, (p_cost - c) / (p_cost_rate * f));
    END IF;
    IF wait = 0 THEN
        r := r - p_requests;
        c := c - p_cost;
    END IF;
    UPDATE kind_quotas SET requests = r, cost = c, refilled_at = at WHERE kind = p_kind;
    RETURN wait;
END
$$;

-- A throttled attempt of `kind` (its remote answered 429): the kind waits `p_pause_secs`
-- in every processor, and its rates halve, unless they did less than a second ago.
-- Returns the factor now in force.
CREATE FUNCTION throttle_kind(p_kind text, p_pause_secs float8, p_recover_secs float8)
RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := clock_timestamp();
    f float8;
BEGIN
    INSERT INTO kind_quotas (kind, requests, cost, refilled_at) VALUES (p_kind, 0, 0, at)
    ON CONFLICT (kind) DO NOTHING;
    UPDATE kind_quotas q SET
        factor = CASE WHEN at - q.throttled_at < interval '1 second' THEN q.factor
                      ELSE greatest(1.0 / 16, kind_quota_factor(q, at, p_recover_secs) / 2) END,
        throttled_at = CASE WHEN at - q.throttled_at < interval '1 second' THEN q.throttled_at
                            ELSE at END,
        paused_until = greatest(q.paused_until, at + make_interval(secs => p_pause_secs)),
        throttles = q.throttles + 1
    WHERE q.kind = p_kind
    RETURNING q.factor INTO f;
    RETURN f;
END
$$;
