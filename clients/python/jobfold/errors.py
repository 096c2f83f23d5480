"""What a handler raises to end its attempt, and how each is answered (docs/processor.md)."""

from typing import Optional


class JobError(Exception):
    """Base of the errors a handler raises; ``status`` is the answer the protocol reads."""

    status = 500

    def __init__(self, message: str = "", retry_after: Optional[float] = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class Retryable(JobError):
    """May succeed later: retried with backoff (not before ``retry_after`` seconds)."""

    status = 500


class Permanent(JobError):
    """Will not succeed: the job is quarantined at once."""

    status = 400


class InvalidInput(JobError):
    """The input itself is wrong: quarantined, never retried."""

    status = 422


class Throttled(JobError):
    """The provider's quota refused it: retried without spending an attempt; the kind backs off."""

    status = 429


class Snooze(JobError):
    """Not now, this job only: runs again after ``delay`` seconds without spending an attempt."""

    status = 503

    def __init__(self, message: str = "", delay: float = 1.0):
        super().__init__(message, retry_after=max(delay, 0))


class Stop(Exception):
    """Raised by :meth:`Job.check` once jobfold said to stop (lease lost, cancelled, ended)."""


class ApiError(Exception):
    """An answer of jobfold's API that is not a success."""

    def __init__(self, status: int, code: str, message: str, body=None):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body
