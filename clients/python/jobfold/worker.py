"""Handlers for jobfold's HTTP protocol: register functions by kind, serve them anywhere.

    worker = Worker(secret=os.environ["JOBFOLD_SECRET"])

    @worker.handler("count-words")
    def count(job):
        return {"words": len(job.input["text"].split())}

    @worker.handler("convert-audio", long=True)      # answers 202, calls back
    def convert(job):
        for step in range(100):
            job.check()                              # raises Stop once jobfold says stop
            job.progress({"percent": step})
        return {"path": "/out/a.flac"}

    worker.serve(port=7000)        # or worker.wsgi / worker.asgi in any WSGI or ASGI server

A function may be ``async def``. It returns the result (any JSON value) or raises one of
:mod:`jobfold.errors`; any other exception is a retryable failure. Calls not signed with
the secret are refused (401). A ``long`` handler's call is answered ``202`` at once; the
function runs in a thread of its own while heartbeats carry its latest progress, and its
result or error is sent to ``complete_url``, signed, retried until jobfold answers.
"""

import asyncio
import inspect
import json
import math
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import signature
from .errors import JobError, Stop

Answer = Tuple[int, List[Tuple[str, str]], bytes]


class Job:
    """One attempt of a job, as jobfold sent it."""

    def __init__(self, body: Dict[str, Any], headers: Mapping[str, str]):
        self.id: str = body["job_id"]
        self.kind: str = body["kind"]
        self.document_id: str = body["document_id"]
        self.input_version: int = body["input_version"]
        self.input: Any = body.get("input")
        self.attempt: int = body.get("attempt", 1)
        self.max_attempts: int = body.get("max_attempts", self.attempt)
        #: "none", "failed" or "ambiguous": whether the last attempt's effects may have happened.
        self.previous_outcome: str = body.get("previous_outcome", "none")
        self.generation: int = body["generation"]
        self.deadline: Optional[str] = body.get("deadline")
        self.heartbeat_url: Optional[str] = body.get("heartbeat_url")
        self.complete_url: Optional[str] = body.get("complete_url")
        #: The same for every attempt at this input version: pass it to what you change outside.
        self.idempotency_key: str = headers.get("idempotency-key") or f"{self.id}:{self.input_version}"
        self.traceparent: Optional[str] = headers.get("traceparent")
        #: Set once jobfold answered a heartbeat with 409: the lease is lost, the job
        #: cancelled or ended. Nothing this attempt returns will count.
        self.stopped = threading.Event()
        self._progress: Any = None
        self._lock = threading.Lock()

    @property
    def last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    @property
    def outcome_unknown(self) -> bool:
        """The last attempt's effects may have happened: reconcile (look the key up) first."""
        return self.previous_outcome == "ambiguous"

    def progress(self, value: Any) -> None:
        """What the next heartbeat reports (any JSON value up to 16 KiB)."""
        with self._lock:
            self._progress = value

    def check(self) -> None:
        """Raises Stop once jobfold said to stop working on this attempt."""
        if self.stopped.is_set():
            raise Stop("jobfold said to stop: the lease was lost, or the job cancelled or ended")

    def _take_progress(self) -> Any:
        with self._lock:
            return self._progress


def _json(status: int, value: Any, retry_after: Optional[float] = None) -> Answer:
    headers = [("Content-Type", "application/json")]
    if retry_after is not None:
        headers.append(("Retry-After", str(max(0, math.ceil(retry_after)))))
    return status, headers, json.dumps(value).encode()


def _failure(error: BaseException) -> Answer:
    if isinstance(error, JobError):
        return _json(error.status, {"error": error.message}, error.retry_after)
    return _json(500, {"error": f"{type(error).__name__}: {error}"})


class _Headers(dict):
    """Header names in lower case."""

    def __init__(self, pairs):
        super().__init__((k.lower(), v) for k, v in pairs)


class Worker:
    """The handlers of one worker process, by kind."""

    def __init__(
        self,
        secret: Optional[str] = None,
        heartbeat_every: float = 10.0,
        tolerance: int = signature.TOLERANCE,
        max_body: int = 8 << 20,
        callback_timeout: float = 10.0,
    ):
        self.secret = secret
        self.heartbeat_every = heartbeat_every
        self.tolerance = tolerance
        self.max_body = max_body
        self.callback_timeout = callback_timeout
        self._handlers: Dict[str, Tuple[Callable, bool]] = {}

    def handler(self, kind: str, long: bool = False) -> Callable:
        """Registers the decorated function for ``kind``; ``long``: answer 202 and call back."""

        def register(fn: Callable) -> Callable:
            self._handlers[kind] = (fn, long)
            return fn

        return register

    # The protocol, whatever serves it.

    def _accept(self, headers: Mapping[str, str], body: bytes):
        """The job and the short handler to run on it here, or the answer already made: the
        call refused, or a long handler started (202)."""
        if len(body) > self.max_body:
            return None, _json(413, {"error": "the job is larger than this worker takes"})
        if self.secret is not None:
            try:
                signature.verify(self.secret, headers.get("jobfold-signature"), body, tolerance=self.tolerance)
            except signature.SignatureError as e:
                return None, _json(401, {"error": str(e)})
        try:
            job = Job(json.loads(body), headers)
        except (ValueError, KeyError, TypeError) as e:
            return None, _json(400, {"error": f"not a job: {e}"})
        found = self._handlers.get(job.kind)
        if found is None:
            return None, _json(404, {"error": f"no handler for kind {job.kind}"})
        fn, long = found
        if long:
            return None, self._start_long(job, fn)
        return (job, fn), None

    def handle(self, headers: Mapping[str, str], body: bytes) -> Answer:
        """Answers one call (header names in lower case), running a short handler here."""
        short, answer = self._accept(headers, body)
        if answer:
            return answer
        job, fn = short
        try:
            result = asyncio.run(fn(job)) if inspect.iscoroutinefunction(fn) else fn(job)
        except Exception as e:  # noqa: BLE001 - every failure is the attempt's answer
            return _failure(e)
        return _json(200, result)

    async def handle_async(self, headers: Mapping[str, str], body: bytes) -> Answer:
        """:meth:`handle` on an event loop: ``async def`` handlers are awaited on it."""
        short, answer = self._accept(headers, body)
        if answer:
            return answer
        job, fn = short
        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(job)
            else:
                result = await asyncio.get_running_loop().run_in_executor(None, fn, job)
        except Exception as e:  # noqa: BLE001
            return _failure(e)
        return _json(200, result)

    # Long jobs: 202, heartbeats, the completion.

    def _start_long(self, job: Job, fn: Callable) -> Answer:
        if not job.complete_url or not job.heartbeat_url:
            return _json(400, {"error": "a long handler needs the call's heartbeat_url and complete_url"})
        runner = threading.Thread(target=self._run_long, args=(job, fn), daemon=True, name=f"jobfold-{job.id}")
        runner.start()
        return _json(202, {"accepted": True})

    def _run_long(self, job: Job, fn: Callable) -> None:
        done = threading.Event()
        beats = threading.Thread(target=self._heartbeats, args=(job, done), daemon=True)
        beats.start()
        try:
            try:
                result = asyncio.run(fn(job)) if inspect.iscoroutinefunction(fn) else fn(job)
                outcome = {"result": result}
            except Stop:
                return
            except JobError as e:
                outcome = {"error": {"status": e.status, "message": e.message, "retry_after": _seconds(e.retry_after)}}
            except Exception as e:  # noqa: BLE001
                outcome = {"error": {"status": 500, "message": f"{type(e).__name__}: {e}"}}
            if not job.stopped.is_set():
                self._complete(job, outcome)
        finally:
            done.set()

    def _heartbeats(self, job: Job, done: threading.Event) -> None:
        while not done.wait(self.heartbeat_every):
            status, _ = self.call_back(job.heartbeat_url, job, {"progress": job._take_progress()})
            if status in (404, 409):
                job.stopped.set()
                return

    def _complete(self, job: Job, outcome: Dict[str, Any]) -> None:
        delay = 0.5
        deadline = time.monotonic() + max(self.callback_timeout * 6, 60)
        while True:
            status, _ = self.call_back(job.complete_url, job, outcome)
            if status == 200 or 400 <= status < 500:
                return
            if time.monotonic() > deadline:
                return
            time.sleep(delay)
            delay = min(delay * 2, 10)

    def call_back(self, url: str, job: Job, fields: Dict[str, Any]) -> Tuple[int, Any]:
        """POSTs a callback for ``job`` (signed when the worker has a secret); (status, body).
        A connection that fails is status 0."""
        payload = {"kind": job.kind, "generation": job.generation}
        payload.update({k: v for k, v in fields.items() if v is not None})
        body = json.dumps(payload).encode()
        request = urllib.request.Request(url, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if self.secret is not None:
            request.add_header(signature.HEADER, signature.sign(self.secret, body))
        try:
            with urllib.request.urlopen(request, timeout=self.callback_timeout) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"null")
            except ValueError:
                return e.code, None
        except (OSError, ValueError):
            return 0, None

    # Servers.

    def wsgi(self, environ, start_response):
        """A WSGI application."""
        if environ.get("REQUEST_METHOD") != "POST":
            status, headers, body = _json(405, {"error": "POST a job"})
        else:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length > self.max_body:
                status, headers, body = _json(413, {"error": "the job is larger than this worker takes"})
            else:
                raw = environ["wsgi.input"].read(length) if length else b""
                pairs = [(k[5:].replace("_", "-"), v) for k, v in environ.items() if k.startswith("HTTP_")]
                status, headers, body = self.handle(_Headers(pairs), raw)
        start_response(f"{status} {_REASONS.get(status, 'Status')}", headers + [("Content-Length", str(len(body)))])
        return [body]

    async def asgi(self, scope, receive, send):
        """An ASGI application (HTTP only)."""
        if scope["type"] != "http":
            return
        chunks = []
        size = 0
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body or not message.get("more_body"):
                break
        if scope["method"] != "POST":
            status, headers, body = _json(405, {"error": "POST a job"})
        elif size > self.max_body:
            status, headers, body = _json(413, {"error": "the job is larger than this worker takes"})
        else:
            pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            status, headers, body = await self.handle_async(_Headers(pairs), b"".join(chunks))
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers + [("Content-Length", str(len(body)))]],
        })
        await send({"type": "http.response.body", "body": body})

    def server(self, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
        """A threading HTTP server for this worker (``serve_forever()`` it)."""
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # One write an answer: a keep-alive call's body would otherwise wait for the
            # caller's delayed ACK (Nagle's algorithm), about 40 ms.
            wbufsize = 1 << 16
            disable_nagle_algorithm = True

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length > worker.max_body:
                    self._answer(*_json(413, {"error": "the job is larger than this worker takes"}))
                    self.close_connection = True
                    return
                raw = self.rfile.read(length) if length else b""
                self._answer(*worker.handle(_Headers(self.headers.items()), raw))

            def _answer(self, status, headers, body):
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        return ThreadingHTTPServer((host, port), Handler)

    def serve(self, host: str = "127.0.0.1", port: int = 7000) -> None:
        """Serves until interrupted."""
        self.server(host, port).serve_forever()


def _seconds(value: Optional[float]) -> Optional[int]:
    return None if value is None else max(0, math.ceil(value))


_REASONS = {
    200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
    405: "Method Not Allowed", 413: "Payload Too Large", 422: "Unprocessable Entity",
    429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable",
}
