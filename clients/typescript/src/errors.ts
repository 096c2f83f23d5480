/** What a handler throws to end its attempt; `status` is the answer the protocol reads. */
export class JobError extends Error {
  override name = "JobError";
  status = 500;
  constructor(message = "", public retryAfter?: number) {
    super(message);
  }
}

/** May succeed later: retried with backoff (not before `retryAfter` seconds). */
export class Retryable extends JobError {
  override name = "Retryable";
  override status = 500;
}

/** Will not succeed: the job is quarantined at once. */
export class Permanent extends JobError {
  override name = "Permanent";
  override status = 400;
}

/** The input itself is wrong: quarantined, never retried. */
export class InvalidInput extends JobError {
  override name = "InvalidInput";
  override status = 422;
}

/** The provider's quota refused it: retried without spending an attempt; the kind backs off. */
export class Throttled extends JobError {
  override name = "Throttled";
  override status = 429;
}

/** Not now, this job only: runs again after `delay` seconds without spending an attempt. */
export class Snooze extends JobError {
  override name = "Snooze";
  override status = 503;
  constructor(message = "", delay = 1) {
    super(message, Math.max(delay, 0));
  }
}

/** Thrown by `job.check()` once jobfold said to stop (lease lost, cancelled, ended). */
export class Stop extends Error {
  override name = "Stop";
}

/** An answer of jobfold's API that is not a success. */
export class ApiError extends Error {
  override name = "ApiError";
  constructor(public status: number, public code: string, message: string, public body?: unknown) {
    super(`${status} ${code}: ${message}`);
  }
}
