#!/usr/bin/env python3
"""The workload of docs/capacity.md's worked example, with the Python standard library.

It stands in for a model provider and for the service that submits conversations:

- a chat-completions endpoint (`POST /v1/chat/completions`) whose answers take a lognormal
  time (median `--median` seconds, spread `--sigma`), and which answers a share
  `--fail-share` of calls `503 Retry-After: 5` (the provider being unwell);
- `--per-minute` summarize-conversation jobs a minute, at Poisson (random, memoryless)
  times, for `--minutes`, posted to the processor's `POST /v1/jobs`.

It prints the window the jobs were submitted in, for `jobfold capacity --since --until`.

    python3 examples/capacity/workload.py --api http://127.0.0.1:8080 --model-port 8090
"""

import argparse
import datetime
import json
import math
import random
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def model_server(port, median, sigma, fail_share, seed):
    rng = random.Random(seed)
    lock = threading.Lock()

    class Model(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Each answer in one write (flushed after the request), not held by Nagle's algorithm.
        wbufsize = 1 << 16
        disable_nagle_algorithm = True

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with lock:
                fail = rng.random() < fail_share
                took = median * math.exp(rng.gauss(0.0, sigma))
            if fail:
                self.answer(503, {"error": "overloaded"}, {"Retry-After": "5"})
                return
            time.sleep(took)
            turns = len(body.get("messages", [])) - 1
            self.answer(200, {"model": "stand-in", "choices": [
                {"message": {"role": "assistant", "content": f"A summary of {turns} messages."}}]})

        def answer(self, status, body, headers=None):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Model)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def submit(api, token, n):
    turns = 4 + n % 9
    messages = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": f"Message {i} of conversation {n}: " + "words " * (20 + 7 * i)}
                for i in range(turns)]
    body = json.dumps({"document_id": f"conversation-{n}", "kind": "summarize-conversation",
                       "input_version": 1, "input": {"messages": messages}}).encode()
    request = urllib.request.Request(f"{api}/v1/jobs", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", default="http://127.0.0.1:8080")
    parser.add_argument("--token", default="")
    parser.add_argument("--model-port", type=int, default=8090)
    parser.add_argument("--median", type=float, default=10.0)
    parser.add_argument("--sigma", type=float, default=0.35)
    parser.add_argument("--fail-share", type=float, default=0.05)
    parser.add_argument("--per-minute", type=float, default=60.0)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--drain", type=float, default=90.0,
                        help="seconds to keep the model up after the last job")
    parser.add_argument("--seed", type=int, default=26)
    args = parser.parse_args()

    model_server(args.model_port, args.median, args.sigma, args.fail_share, args.seed)
    rng = random.Random(args.seed + 1)
    rate = args.per_minute / 60.0
    since = datetime.datetime.now(datetime.timezone.utc)
    start = time.monotonic()
    at, n = 0.0, 0
    while True:
        at += rng.expovariate(rate)
        if at >= args.minutes * 60:
            break
        time.sleep(max(0.0, start + at - time.monotonic()))
        submit(args.api, args.token, n)
        n += 1
    time.sleep(max(0.0, start + args.minutes * 60 - time.monotonic()))
    until = since + datetime.timedelta(seconds=args.minutes * 60)
    print(f"submitted {n} jobs", file=sys.stderr)
    print(f"--since {since.isoformat()} --until {until.isoformat()}", flush=True)
    time.sleep(args.drain)


if __name__ == "__main__":
    main()
