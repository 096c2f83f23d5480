// The library's own checks (npm test). What it does against the real processor is checked by
// the Rust test `the_typescript_library_runs_short_and_long_jobs_against_the_processor`
// (tests/tests/clients.rs).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import * as http from "node:http";
import { after, before, describe, it } from "node:test";

import { Client, InvalidInput, Permanent, Retryable, Snooze, Stop, Throttled, Worker, sign, verify, portOf } from "../index.js";

const SECRET = "typescript-library-test-secret-0123456789";
// dist/src/test/ → the repository's docs/openapi.json.
const SPEC = JSON.parse(readFileSync(new URL("../../../../../docs/openapi.json", import.meta.url), "utf8"));

/** `body` has every property `schema` (of docs/openapi.json) requires and no other. */
function conforms(schema: string, body: Record<string, unknown>) {
  const described = SPEC.components.schemas[schema];
  for (const field of described.required ?? []) assert.ok(field in body, `${schema} requires ${field}: ${JSON.stringify(body)}`);
  for (const field of Object.keys(body)) assert.ok(field in described.properties, `${schema} has no ${field}`);
}

function jobBody(kind = "echo", extra: Record<string, unknown> = {}): Buffer {
  return Buffer.from(
    JSON.stringify({
      job_id: "0190c0de-0000-7000-8000-000000000001",
      kind,
      document_id: "doc-1",
      input_version: 1,
      input: { text: "a b c" },
      attempt: 1,
      max_attempts: 3,
      previous_outcome: "none",
      generation: 4,
      deadline: null,
      ...extra,
    }),
  );
}

const signed = (body: Buffer) => ({ "jobfold-signature": sign(SECRET, body), "idempotency-key": "k:1" });

async function waitFor(check: () => boolean) {
  const deadline = Date.now() + 10_000;
  while (!check()) {
    assert.ok(Date.now() < deadline, "timed out");
    await new Promise((r) => setTimeout(r, 20));
  }
}

describe("signature", () => {
  it("is HMAC-SHA256 of the time, a dot and the body", () => {
    // printf '1700000000.{}' | openssl dgst -sha256 -hmac key; the processor's own test has the same.
    assert.equal(sign("key", "{}", 1700000000), "t=1700000000,v1=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae");
  });

  it("verifies only for its body, secret and time", () => {
    const header = sign(SECRET, "{}", 1700000000);
    verify(SECRET, header, "{}", 1700000100);
    assert.throws(() => verify(SECRET, header, "{ }", 1700000000));
    assert.throws(() => verify("another-" + SECRET, header, "{}", 1700000000));
    assert.throws(() => verify(SECRET, header, "{}", 1700000301), /301 s away/);
    for (const bad of [undefined, "", "v1=00", "t=1700000000", "t=soon,v1=00", "junk"]) {
      assert.throws(() => verify(SECRET, bad, "{}", 1700000000));
    }
    verify(SECRET, header + ",v1=" + "00".repeat(32), "{}", 1700000000);
  });
});

describe("worker", () => {
  const worker = new Worker({ secret: SECRET });
  const seen: any[] = [];
  worker.handler("echo", (job) => {
    seen.push(job);
    return { words: job.input.text.split(" ").length, key: job.idempotencyKey };
  });
  worker.handler("async-echo", async (job) => ({ attempt: job.attempt, last: job.lastAttempt, unknown: job.outcomeUnknown }));
  const failures: Record<string, Error> = {
    invalid: new InvalidInput("no text"),
    permanent: new Permanent("never"),
    retry: new Retryable("later", 7.2),
    throttled: new Throttled("quota", 3),
    snooze: new Snooze("not yet", 30),
    boom: new Error("a bug"),
  };
  for (const [kind, error] of Object.entries(failures)) {
    worker.handler(kind, () => {
      throw error;
    });
  }

  it("runs a signed call's kind", async () => {
    const body = jobBody();
    const answer = await worker.handle(signed(body), body);
    assert.deepEqual([answer.status, answer.body], [200, { words: 3, key: "k:1" }]);
    assert.equal(seen[0].previousOutcome, "none");
    const later = jobBody("async-echo", { attempt: 3, previous_outcome: "ambiguous" });
    const again = await worker.handle(signed(later), later);
    assert.deepEqual(again.body, { attempt: 3, last: true, unknown: true });
  });

  it("refuses unsigned, stale and forged calls before any handler", async () => {
    const body = jobBody();
    seen.length = 0;
    for (const headers of [
      {},
      { "jobfold-signature": sign(SECRET, body, Math.floor(Date.now() / 1000) - 600) },
      { "jobfold-signature": sign("not-the-" + SECRET, body) },
    ]) {
      assert.equal((await worker.handle(headers, body)).status, 401);
    }
    assert.equal(seen.length, 0);
  });

  it("answers each error with the status the protocol reads", async () => {
    const expected: Record<string, [number, string | undefined]> = {
      invalid: [422, undefined],
      permanent: [400, undefined],
      retry: [500, "8"],
      throttled: [429, "3"],
      snooze: [503, "30"],
      boom: [500, undefined],
    };
    for (const [kind, [status, retryAfter]] of Object.entries(expected)) {
      const body = jobBody(kind);
      const answer = await worker.handle(signed(body), body);
      assert.deepEqual([answer.status, answer.headers["retry-after"]], [status, retryAfter], kind);
    }
    const body = jobBody("nobody");
    assert.equal((await worker.handle(signed(body), body)).status, 404);
  });
});

describe("long jobs", () => {
  let server: http.Server;
  let received: [string, any][] = [];
  let reply = 200;
  let urls: Record<string, string>;

  before(async () => {
    server = http.createServer((request, response) => {
      const chunks: Buffer[] = [];
      request.on("data", (c) => chunks.push(c));
      request.on("end", () => {
        const raw = Buffer.concat(chunks);
        verify(SECRET, request.headers["jobfold-signature"] as string, raw);
        received.push([request.url!, JSON.parse(raw.toString())]);
        response.writeHead(reply, { "content-type": "application/json" });
        response.end(JSON.stringify(reply === 200 ? { recorded: true } : { error: { state: "cancelled" } }));
      });
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", () => r()));
    const base = `http://127.0.0.1:${portOf(server)}/v1/jobs/x`;
    urls = { heartbeat_url: `${base}/heartbeat`, complete_url: `${base}/complete` };
  });

  after(() => server.close());

  it("answers 202, heartbeats, then completes, signed", async () => {
    received = [];
    reply = 200;
    const worker = new Worker({ secret: SECRET, heartbeatEvery: 0.05 });
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    worker.handler(
      "convert",
      async (job) => {
        job.progress({ percent: 50 });
        await released;
        return { path: "/out/a.flac" };
      },
      { long: true },
    );
    const body = jobBody("convert", urls);
    assert.equal((await worker.handle(signed(body), body)).status, 202);
    await waitFor(() => received.some(([p]) => p.endsWith("/heartbeat")));
    assert.deepEqual(received[0][1], { kind: "convert", generation: 4, progress: { percent: 50 } });
    conforms("Heartbeat", received[0][1]);
    release();
    await waitFor(() => received.some(([p]) => p.endsWith("/complete")));
    const done = received.filter(([p]) => p.endsWith("/complete")).map(([, b]) => b);
    assert.deepEqual(done, [{ kind: "convert", generation: 4, result: { path: "/out/a.flac" } }]);
    conforms("Complete", done[0]);
    conforms("HandlerCall", JSON.parse(body.toString()));
  });

  it("stops at a 409 to a heartbeat and completes nothing", async () => {
    received = [];
    reply = 409;
    const worker = new Worker({ secret: SECRET, heartbeatEvery: 0.05 });
    let ended!: () => void;
    const stopped = new Promise<void>((r) => (ended = r));
    worker.handler(
      "convert",
      async (job) => {
        try {
          for (;;) {
            job.check();
            await new Promise((r) => setTimeout(r, 10));
          }
        } catch (e) {
          assert.ok(e instanceof Stop);
          ended();
          throw e;
        }
      },
      { long: true },
    );
    const body = jobBody("convert", urls);
    assert.equal((await worker.handle(signed(body), body)).status, 202);
    await stopped;
    // The handler threw Stop: the run has nothing left to send after this turn of the loop.
    await new Promise((r) => setImmediate(r));
    assert.ok(!received.some(([p]) => p.endsWith("/complete")), JSON.stringify(received));
  });

  it("completes a long handler's error with its status", async () => {
    received = [];
    reply = 200;
    const worker = new Worker({ secret: SECRET, heartbeatEvery: 5 });
    worker.handler(
      "convert",
      () => {
        throw new Snooze("the source is not uploaded yet", 20);
      },
      { long: true },
    );
    const body = jobBody("convert", urls);
    await worker.handle(signed(body), body);
    await waitFor(() => received.length > 0);
    assert.deepEqual(received[0][1].error, { status: 503, message: "the source is not uploaded yet", retry_after: 20 });
    conforms("Complete", received[0][1]);
  });
});

describe("client", () => {
  it("submits what the API describes, with a key of its own", async () => {
    const seen: [string, string | undefined, any][] = [];
    const server = http.createServer((request, response) => {
      const chunks: Buffer[] = [];
      request.on("data", (c) => chunks.push(c));
      request.on("end", () => {
        seen.push([request.url!, request.headers.authorization, JSON.parse(Buffer.concat(chunks).toString())]);
        response.writeHead(201, { "content-type": "application/json" });
        response.end(JSON.stringify({ job_id: "0190c0de-0000-7000-8000-000000000002", created: true }));
      });
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", () => r()));
    try {
      const client = new Client(`http://127.0.0.1:${portOf(server)}`, { token: "t0k" });
      assert.equal((await client.submit("count-words", "doc-1", { text: "a b" }, { delay: "90s" })).created, true);
      await client.submit("count-words", "doc-1", { text: "a b" }, { idempotencyKey: "mine" });
    } finally {
      server.close();
    }
    const [[path, auth, first], [, , second]] = seen;
    assert.deepEqual([path, auth], ["/v1/jobs", "Bearer t0k"]);
    conforms("SubmitJob", first);
    assert.ok(first.idempotency_key);
    assert.equal(second.idempotency_key, "mine");
  });
});
