"""The library's own checks, standard library only: python3 -m unittest discover clients/python/tests.

What it does against the real processor is checked by the Rust test
`the_python_library_runs_short_and_long_jobs_against_the_processor` (tests/tests/clients.rs).
"""

import asyncio
import io
import json
import os
import sys
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jobfold  # noqa: E402
from jobfold import InvalidInput, Permanent, Retryable, Snooze, Throttled, Worker  # noqa: E402

SECRET = "python-library-test-secret-0123456789"
SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "openapi.json")


def conforms(test, schema, body):
    """``body`` has every property ``schema`` (of docs/openapi.json) requires and no other."""
    with open(SPEC) as f:
        described = json.load(f)["components"]["schemas"][schema]
    test.assertLessEqual(set(described.get("required", [])), set(body), f"{schema}: {body}")
    test.assertLessEqual(set(body), set(described["properties"]), f"{schema}: {body}")


def job_body(kind="echo", **extra):
    body = {
        "job_id": "0190c0de-0000-7000-8000-000000000001", "kind": kind, "document_id": "doc-1",
        "input_version": 1, "input": {"text": "a b c"}, "attempt": 1, "max_attempts": 3,
        "previous_outcome": "none", "generation": 4, "deadline": None,
    }
    body.update(extra)
    return json.dumps(body).encode()


def call_wsgi(worker, body, headers=None, method="POST"):
    environ = {
        "REQUEST_METHOD": method, "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
    }
    for name, value in (headers or {}).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    answered = {}

    def start_response(status, headers):
        answered["status"] = int(status.split()[0])
        answered["headers"] = dict(headers)

    out = b"".join(worker.wsgi(environ, start_response))
    return answered["status"], answered["headers"], json.loads(out)


def call_asgi(worker, body, headers=None):
    sent = []

    async def run():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http", "method": "POST",
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        }
        await worker.asgi(scope, receive, send)

    asyncio.run(run())
    start, body_message = sent
    return start["status"], dict((k.decode(), v.decode()) for k, v in start["headers"]), json.loads(body_message["body"])


class SignatureTest(unittest.TestCase):
    def test_the_signature_is_hmac_sha256_of_the_time_a_dot_and_the_body(self):
        # printf '1700000000.{}' | openssl dgst -sha256 -hmac key; the processor's own test has the same.
        self.assertEqual(
            jobfold.sign("key", b"{}", 1700000000),
            "t=1700000000,v1=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae",
        )

    def test_a_signature_verifies_only_for_its_body_secret_and_time(self):
        header = jobfold.sign(SECRET, b"{}", 1700000000)
        jobfold.verify(SECRET, header, b"{}", now=1700000100)
        for secret, body, now in [(SECRET, b"{ }", 1700000000), ("another-" + SECRET, b"{}", 1700000000), (SECRET, b"{}", 1700000301)]:
            with self.assertRaises(jobfold.SignatureError):
                jobfold.verify(secret, header, body, now=now)
        for bad in [None, "", "v1=00", "t=1700000000", "t=soon,v1=00", "junk"]:
            with self.assertRaises(jobfold.SignatureError):
                jobfold.verify(SECRET, bad, b"{}", now=1700000000)
        jobfold.verify(SECRET, header + ",v1=" + "00" * 32, b"{}", now=1700000000)


class WorkerTest(unittest.TestCase):
    def setUp(self):
        self.worker = Worker(secret=SECRET)
        seen = self.seen = []

        @self.worker.handler("echo")
        def echo(job):
            seen.append(job)
            return {"words": len(job.input["text"].split()), "key": job.idempotency_key}

        @self.worker.handler("async-echo")
        async def async_echo(job):
            await asyncio.sleep(0)
            return {"attempt": job.attempt, "last": job.last_attempt}

        failures = {
            "invalid": InvalidInput("no text"), "permanent": Permanent("never"),
            "retry": Retryable("later", retry_after=7.2), "throttled": Throttled("quota", retry_after=3),
            "snooze": Snooze("not yet", delay=30), "boom": RuntimeError("a bug"),
        }
        for kind, error in failures.items():
            self.worker.handler(kind)(lambda job, error=error: (_ for _ in ()).throw(error))

    def signed(self, body):
        return {"Jobfold-Signature": jobfold.sign(SECRET, body), "Idempotency-Key": "k:1"}

    def test_a_signed_call_runs_its_kinds_handler_under_wsgi_and_asgi(self):
        body = job_body()
        status, _, answer = call_wsgi(self.worker, body, self.signed(body))
        self.assertEqual((status, answer), (200, {"words": 3, "key": "k:1"}))
        job = self.seen[0]
        self.assertEqual((job.previous_outcome, job.outcome_unknown, job.max_attempts), ("none", False, 3))
        body = job_body("async-echo", attempt=3, previous_outcome="ambiguous")
        status, _, answer = call_asgi(self.worker, body, self.signed(body))
        self.assertEqual((status, answer), (200, {"attempt": 3, "last": True}))

    def test_unsigned_stale_and_forged_calls_are_refused_before_any_handler(self):
        body = job_body()
        stale = {"Jobfold-Signature": jobfold.sign(SECRET, body, int(time.time()) - 600)}
        forged = {"Jobfold-Signature": jobfold.sign("not-the-" + SECRET, body)}
        for headers in [{}, stale, forged]:
            self.assertEqual(call_wsgi(self.worker, body, headers)[0], 401)
            self.assertEqual(call_asgi(self.worker, body, headers)[0], 401)
        self.assertEqual(self.seen, [])

    def test_each_error_is_answered_with_the_status_the_protocol_reads(self):
        expected = {
            "invalid": (422, None), "permanent": (400, None), "retry": (500, "8"),
            "throttled": (429, "3"), "snooze": (503, "30"), "boom": (500, None),
        }
        for kind, (status, retry_after) in expected.items():
            body = job_body(kind)
            got, headers, answer = call_wsgi(self.worker, body, self.signed(body))
            self.assertEqual((got, headers.get("Retry-After")), (status, retry_after), kind)
            self.assertIn("error", answer)
        body = job_body("nobody")
        self.assertEqual(call_wsgi(self.worker, body, self.signed(body))[0], 404)


class Callbacks(BaseHTTPRequestHandler):
    """Stands in for the processor's callback routes: records each, answers as told."""

    received = []
    answer = 200

    def do_POST(self):
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        jobfold.verify(SECRET, self.headers.get("Jobfold-Signature"), raw)
        Callbacks.received.append((self.path, json.loads(raw)))
        body = json.dumps({"recorded": True} if Callbacks.answer == 200 else {"error": {"state": "cancelled"}}).encode()
        self.send_response(Callbacks.answer)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class LongJobTest(unittest.TestCase):
    def setUp(self):
        Callbacks.received = []
        Callbacks.answer = 200
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Callbacks)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{self.server.server_address[1]}/v1/jobs/x"
        self.urls = {"heartbeat_url": base + "/heartbeat", "complete_url": base + "/complete"}

    def tearDown(self):
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, check):
        deadline = time.monotonic() + 10
        while not check():
            self.assertLess(time.monotonic(), deadline, Callbacks.received)
            time.sleep(0.02)

    def test_a_long_handler_is_answered_202_and_heartbeats_then_completes_signed(self):
        worker = Worker(secret=SECRET, heartbeat_every=0.05)
        release = threading.Event()

        @worker.handler("convert", long=True)
        def convert(job):
            job.progress({"percent": 50})
            release.wait(5)
            return {"path": "/out/a.flac"}

        body = job_body("convert", **self.urls)
        status, _, _ = call_wsgi(worker, body, {"Jobfold-Signature": jobfold.sign(SECRET, body)})
        self.assertEqual(status, 202)
        self.wait_for(lambda: any(p.endswith("/heartbeat") for p, _ in Callbacks.received))
        path, beat = Callbacks.received[0]
        self.assertEqual(beat, {"kind": "convert", "generation": 4, "progress": {"percent": 50}})
        conforms(self, "Heartbeat", beat)
        release.set()
        self.wait_for(lambda: any(p.endswith("/complete") for p, _ in Callbacks.received))
        done = [b for p, b in Callbacks.received if p.endswith("/complete")]
        self.assertEqual(done, [{"kind": "convert", "generation": 4, "result": {"path": "/out/a.flac"}}])
        conforms(self, "Complete", done[0])
        conforms(self, "HandlerCall", json.loads(body))

    def test_a_409_to_a_heartbeat_stops_the_handler_and_nothing_is_completed(self):
        worker = Worker(secret=SECRET, heartbeat_every=0.05)
        stopped = threading.Event()

        @worker.handler("convert", long=True)
        def convert(job):
            while True:
                try:
                    job.check()
                except jobfold.Stop:
                    stopped.set()
                    raise
                time.sleep(0.01)

        Callbacks.answer = 409
        body = job_body("convert", **self.urls)
        self.assertEqual(call_wsgi(worker, body, {"Jobfold-Signature": jobfold.sign(SECRET, body)})[0], 202)
        self.assertTrue(stopped.wait(5))
        # The run's thread has ended: whatever it was going to send, it sent.
        for thread in threading.enumerate():
            if thread.name == "jobfold-0190c0de-0000-7000-8000-000000000001":
                thread.join(5)
                self.assertFalse(thread.is_alive())
        self.assertFalse(any(p.endswith("/complete") for p, _ in Callbacks.received), Callbacks.received)

    def test_a_long_handlers_error_is_completed_with_its_status(self):
        worker = Worker(secret=SECRET, heartbeat_every=5)

        @worker.handler("convert", long=True)
        def convert(job):
            raise Snooze("the source is not uploaded yet", delay=20)

        body = job_body("convert", **self.urls)
        call_wsgi(worker, body, {"Jobfold-Signature": jobfold.sign(SECRET, body)})
        self.wait_for(lambda: Callbacks.received)
        self.assertEqual(
            Callbacks.received[0][1]["error"],
            {"status": 503, "message": "the source is not uploaded yet", "retry_after": 20},
        )
        conforms(self, "Complete", Callbacks.received[0][1])


class Api(BaseHTTPRequestHandler):
    """Stands in for POST /v1/jobs: records the body, answers 201."""

    received = []

    def do_POST(self):
        Api.received.append((self.path, self.headers.get("Authorization"), json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        body = json.dumps({"job_id": "0190c0de-0000-7000-8000-000000000002", "created": True}).encode()
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class ClientTest(unittest.TestCase):
    def test_a_submit_is_what_the_api_describes_with_a_key_of_its_own(self):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            client = jobfold.Client(f"http://127.0.0.1:{server.server_address[1]}", token="t0k")
            accepted = client.submit("count-words", "doc-1", {"text": "a b"}, delay="90s")
            self.assertEqual(accepted["created"], True)
            client.submit("count-words", "doc-1", {"text": "a b"}, idempotency_key="mine")
        finally:
            server.shutdown()
            server.server_close()
        (path, auth, first), (_, _, second) = Api.received
        self.assertEqual((path, auth), ("/v1/jobs", "Bearer t0k"))
        conforms(self, "SubmitJob", first)
        self.assertTrue(first["idempotency_key"])
        self.assertEqual(second["idempotency_key"], "mine")


if __name__ == "__main__":
    unittest.main()
