"""Signed calls: ``Jobfold-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``.

The scheme of Stripe's and GitHub's webhooks. The receiver recomputes the MAC over the
timestamp and the raw body, compares in constant time, and refuses a timestamp more than
``tolerance`` seconds from its clock (a captured call cannot be replayed later).
"""

import hashlib
import hmac
import time
from typing import Optional, Union

HEADER = "Jobfold-Signature"
TOLERANCE = 300
_MAX_HEADER = 1024


class SignatureError(Exception):
    """A call whose signature is missing, malformed, stale or wrong."""


def _key(secret: Union[str, bytes]) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def sign(secret: Union[str, bytes], body: bytes, at: Optional[int] = None) -> str:
    """The header value signing ``body`` at ``at`` (unix seconds; now if None)."""
    at = int(time.time()) if at is None else at
    mac = hmac.new(_key(secret), f"{at}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={at},v1={mac}"


def verify(
    secret: Union[str, bytes],
    header: Optional[str],
    body: bytes,
    now: Optional[int] = None,
    tolerance: int = TOLERANCE,
) -> None:
    """Raises SignatureError unless ``header`` signs ``body`` with ``secret`` within ``tolerance``."""
    if not header:
        raise SignatureError("the call is not signed: it needs the header Jobfold-Signature")
    if len(header) > _MAX_HEADER:
        raise SignatureError("the Jobfold-Signature header is malformed")
    at = None
    signatures = []
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise SignatureError("the Jobfold-Signature header is malformed")
        if name == "t" and at is None:
            try:
                at = int(value)
            except ValueError:
                raise SignatureError("the Jobfold-Signature header is malformed") from None
        elif name == "v1":
            signatures.append(value)
    if at is None or not signatures:
        raise SignatureError("the Jobfold-Signature header is malformed: t=<unix seconds>,v1=<hex>")
    now = int(time.time()) if now is None else now
    if abs(now - at) > tolerance:
        raise SignatureError(
            f"the signature's time is {now - at} s away from this clock, more than {tolerance} s"
        )
    expected = hmac.new(_key(secret), f"{at}.".encode() + body, hashlib.sha256).hexdigest()
    if not any(hmac.compare_digest(expected, s) for s in signatures):
        raise SignatureError("the signature does not match the body: another secret, or a changed body")
