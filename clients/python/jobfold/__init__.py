"""jobfold for Python: handlers over jobfold's HTTP protocol, and a submit client.

See :mod:`jobfold.worker` and :mod:`jobfold.client`; the protocol is docs/processor.md,
"Handlers over HTTP".
"""

from .client import Client
from .errors import ApiError, InvalidInput, JobError, Permanent, Retryable, Snooze, Stop, Throttled
from .signature import SignatureError, sign, verify
from .worker import Job, Worker

__all__ = [
    "ApiError", "Client", "InvalidInput", "Job", "JobError", "Permanent", "Retryable",
    "SignatureError", "Snooze", "Stop", "Throttled", "Worker", "sign", "verify",
]
