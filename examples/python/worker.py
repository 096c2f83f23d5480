#!/usr/bin/env python3
"""A jobfold handler in Python, over jobfold's HTTP handler protocol (standard library only).

It runs the kind `count-words`: input {"text": "..."}, result {"words": n, "longest": "..."}.
Point a kind at it in the processor's configuration and run the shipped processor:

    python3 examples/python/worker.py --port 7000
    # jobfold.toml
    [kinds.count-words]
    url = "http://127.0.0.1:7000/count-words"
    run_timeout = "30s"

The protocol (docs/processor.md, "Handlers over HTTP"): one POST per attempt with the job as
JSON - job_id, kind, document_id, input_version, input, attempt, generation, deadline - and
the headers Idempotency-Key (the same for every attempt of the job at one input version) and
traceparent. Answer 2xx with the JSON result to succeed; 422 when the input is wrong (the job
is quarantined, never retried); 429 or 5xx, with Retry-After if you know when, to be retried;
any other 4xx fails the job permanently. The processor keeps the job's lease while the call
runs and closes the connection when the lease is lost or it shuts down.

--port 0 takes a free port; the first line printed says which.
"""

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 1 << 20


def count_words(job):
    """The work itself: returns (status, body)."""
    text = job.get("input", {}).get("text")
    if not isinstance(text, str):
        return 422, {"error": "input.text must be a string"}
    words = text.split()
    return 200, {
        "words": len(words),
        "longest": max(words, key=len, default=""),
        # Shown so a caller can see the key of a repeated attempt is the same.
        "idempotency_key": job.get("idempotency_key"),
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Each response leaves in one write: written as headers and then body, the body of a
    # keep-alive call waits for the caller's delayed ACK (Nagle's algorithm), about 40 ms.
    # The buffer is flushed once the request is handled; Nagle is off for what is bigger.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True

    def do_POST(self):
        if self.path != "/count-words":
            return self.answer(404, {"error": f"no kind at {self.path}"})
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            return self.answer(413, {"error": "job too large"})
        try:
            job = json.loads(self.rfile.read(length))
        except ValueError as e:
            return self.answer(400, {"error": f"not JSON: {e}"})
        job["idempotency_key"] = self.headers.get("Idempotency-Key")
        status, body = count_words(job)
        self.answer(status, body)

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):
        sys.stderr.write("worker.py: " + (format % args) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7000)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"listening on {server.server_address[0]}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
