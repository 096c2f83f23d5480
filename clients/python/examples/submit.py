#!/usr/bin/env python3
"""Submits jobs with the jobfold client and waits for each; prints one JSON line a job.

    python3 clients/python/examples/submit.py --api http://127.0.0.1:8080 \
        --job count-words '{"text": "three little words"}' --job transcode '{"seconds": 300}'
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jobfold import Client  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--api", required=True)
parser.add_argument("--token", default=os.environ.get("JOBFOLD_TOKEN"))
parser.add_argument("--job", nargs=2, action="append", metavar=("KIND", "INPUT"), required=True)
parser.add_argument("--timeout", type=float, default=600)
args = parser.parse_args()

client = Client(args.api, token=args.token)
submitted = [
    (kind, client.submit(kind, f"doc-{n}", json.loads(text))) for n, (kind, text) in enumerate(args.job)
]
for kind, accepted in submitted:
    job = client.wait(accepted["job_id"], timeout=args.timeout)
    result = client.result(job["job_id"]) if job["state"] == "succeeded" else None
    print(json.dumps({"kind": kind, "job_id": job["job_id"], "state": job["state"],
                      "attempt": job["attempt"], "result": result}), flush=True)
