"""Submitting jobs to jobfold over HTTP, safely retried.

    client = Client("http://127.0.0.1:8080", token=os.environ.get("JOBFOLD_TOKEN"))
    job = client.submit("count-words", "doc-1", {"text": "three little words"})
    done = client.wait(job["job_id"])            # {"state": "succeeded", ...}
    client.result(job["job_id"])                 # {"words": 3, ...}

Every submit carries an idempotency key (yours, or one made for the call): a submit that
fails on the way (a lost connection, a 5xx) is sent again with the same key, so the job is
accepted once; the answer says ``created`` False for a retry that found it.
"""

import json
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, Dict, List, Optional

from .errors import ApiError

TERMINAL = ("succeeded", "quarantined", "superseded", "cancelled")


class Client:
    def __init__(self, base_url: str, token: Optional[str] = None, timeout: float = 10.0, retries: int = 3):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retries = retries

    def _request(self, method: str, path: str, body: Any = None, retry: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        delay = 0.2
        for attempt in range(self.retries + 1 if retry else 1):
            request = urllib.request.Request(self.base_url + path, data=data, method=method)
            request.add_header("Accept", "application/json")
            if data is not None:
                request.add_header("Content-Type", "application/json")
            if self.token:
                request.add_header("Authorization", f"Bearer {self.token}")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                    return json.loads(answer.read() or b"null")
            except urllib.error.HTTPError as e:
                raw = e.read()
                try:
                    said = json.loads(raw or b"null")
                except ValueError:
                    said = None
                error = (said or {}).get("error") if isinstance(said, dict) else None
                error = error if isinstance(error, dict) else {}
                failure = ApiError(e.code, error.get("code", "http_error"), error.get("message", raw.decode(errors="replace")), said)
                if not (retry and e.code >= 500 and attempt < self.retries):
                    raise failure from None
            except (OSError, ValueError) as e:
                if not (retry and attempt < self.retries):
                    raise ApiError(0, "unreachable", f"{method} {path}: {e}") from None
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def submit(
        self,
        kind: str,
        document_id: str,
        input: Any,
        input_version: int = 1,
        idempotency_key: Optional[str] = None,
        run_at: Optional[str] = None,
        delay: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Accepts a job: ``{"job_id", "created"}``. Retried with the same idempotency key."""
        body = {
            "kind": kind,
            "document_id": document_id,
            "input_version": input_version,
            "input": input,
            "idempotency_key": idempotency_key or str(uuid.uuid4()),
        }
        if run_at is not None:
            body["run_at"] = run_at
        if delay is not None:
            body["delay"] = delay
        return self._request("POST", "/v1/jobs", body, retry=True)

    def submit_batch(self, jobs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Accepts up to 1,000 jobs in one transaction; each item's answer in order (one bad
        job fails only itself). Jobs without an idempotency key get one."""
        items = [dict(job, idempotency_key=job.get("idempotency_key") or str(uuid.uuid4())) for job in jobs]
        for item in items:
            item.setdefault("input_version", 1)
        return self._request("POST", "/v1/jobs/batch", {"jobs": items}, retry=True)["jobs"]

    def job(self, job_id: str) -> Dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{urllib.parse.quote(job_id)}")

    def result(self, job_id: str) -> Any:
        return self._request("GET", f"/v1/jobs/{urllib.parse.quote(job_id)}/result")

    def cancel(self, job_id: str, reason: Optional[str] = None) -> Dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{urllib.parse.quote(job_id)}/cancel", {"reason": reason} if reason else {})

    def wait(self, job_id: str, timeout: float = 60.0, poll: float = 0.2) -> Dict[str, Any]:
        """The job once it ended (succeeded, quarantined, superseded, cancelled)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("state") in TERMINAL:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.get('state')} after {timeout} s")
            time.sleep(poll)
