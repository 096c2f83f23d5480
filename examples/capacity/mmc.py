#!/usr/bin/env python3
"""A workload whose queueing is known (M/M/c), with the Python standard library.

- a handler over HTTP (`POST /work`) that sleeps each job's `input.ms` and answers in one
  write;
- jobs of kind `work` posted to the processor's `POST /v1/jobs` at Poisson (random,
  memoryless) times, `--rate` a second for `--seconds`, each with an exponential service
  time of mean `--mean-ms`.

It prints the window the jobs were submitted in, for `jobfold capacity --since --until`,
once every job of the window has ended (`GET /v1/kinds`).

    python3 examples/capacity/mmc.py --api http://127.0.0.1:8080 --handler-port 8091 \\
        --rate 15 --mean-ms 200 --seconds 180
"""

import argparse
import concurrent.futures
import datetime
import json
import random
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Work(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Each answer in one write (flushed after the request), not held by Nagle's algorithm.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True

    def do_POST(self):
        job = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        ms = job.get("input", {}).get("ms", 0)
        time.sleep(ms / 1000.0)
        data = json.dumps({"slept_ms": ms}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def call(api, token, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{api}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"null")


def open_jobs(api, token, kind):
    for row in call(api, token, "GET", "/v1/kinds").get("kinds", []):
        if row.get("kind") == kind:
            counts = row.get("open", {})
            return sum(counts.get(state, 0) for state in ("queued", "leased", "retry_wait"))
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", default="http://127.0.0.1:8080")
    parser.add_argument("--token", default="")
    parser.add_argument("--handler-port", type=int, default=8091)
    parser.add_argument("--rate", type=float, default=15.0, help="arrivals a second")
    parser.add_argument("--mean-ms", type=float, default=200.0, help="mean service time")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--kind", default="work")
    parser.add_argument("--seed", type=int, default=26)
    args = parser.parse_args()

    server = ThreadingHTTPServer(("127.0.0.1", args.handler_port), Work)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()

    rng = random.Random(args.seed)
    since = datetime.datetime.now(datetime.timezone.utc)
    start = time.monotonic()
    at, n, posts = 0.0, 0, []
    # Open loop: each job posted at its own time, a slow accept holding no other.
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        while True:
            at += rng.expovariate(args.rate)
            if at >= args.seconds:
                break
            ms = max(1, round(rng.expovariate(1.0 / args.mean_ms)))
            job = {"document_id": f"mmc-{args.seed}-{n}", "kind": args.kind, "input_version": 1,
                   "input": {"ms": ms}}
            time.sleep(max(0.0, start + at - time.monotonic()))
            posts.append(pool.submit(call, args.api, args.token, "POST", "/v1/jobs", job))
            n += 1
        for post in posts:
            post.result()
    time.sleep(max(0.0, start + args.seconds - time.monotonic()))
    until = since + datetime.timedelta(seconds=args.seconds)
    while open_jobs(args.api, args.token, args.kind) > 0:
        time.sleep(0.5)
    print(f"submitted {n} jobs", file=sys.stderr)
    print(f"--since {since.isoformat()} --until {until.isoformat()}", flush=True)


if __name__ == "__main__":
    main()
