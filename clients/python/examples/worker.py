#!/usr/bin/env python3
"""A worker on the jobfold library: `count-words` answers at once, `transcode` is a long job
(answers 202, heartbeats its progress, completes by calling back).

    JOBFOLD_SECRET=... python3 clients/python/examples/worker.py --port 7000

The first line printed is the port it listens on (--port 0 takes a free one).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jobfold import InvalidInput, Worker  # noqa: E402

worker = Worker(
    secret=os.environ.get("JOBFOLD_SECRET"),
    heartbeat_every=float(os.environ.get("JOBFOLD_HEARTBEAT_EVERY", "10")),
)


@worker.handler("count-words")
def count_words(job):
    text = job.input.get("text")
    if not isinstance(text, str):
        raise InvalidInput("input.text must be a string")
    return {"words": len(text.split()), "attempt": job.attempt}


@worker.handler("transcode", long=True)
def transcode(job):
    started = time.monotonic()
    seconds = float(job.input.get("seconds", 60))
    while time.monotonic() - started < seconds:
        job.check()  # raises Stop once jobfold says the job is cancelled or the lease lost
        job.progress({"done": round((time.monotonic() - started) / seconds, 3)})
        time.sleep(min(0.5, seconds))
    return {"seconds": round(time.monotonic() - started, 1), "source": job.input.get("source")}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7000)
    args = parser.parse_args()
    server = worker.server(args.host, args.port)
    print(server.server_address[1], flush=True)
    server.serve_forever()
