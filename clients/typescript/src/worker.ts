/**
 * Handlers for jobfold's HTTP protocol: register functions by kind, serve them with
 * `node:http` or mount `worker.listener` in any server that takes one (Express, Fastify's
 * raw routes, …).
 *
 *     const worker = new Worker({ secret: process.env.JOBFOLD_SECRET });
 *     worker.handler("count-words", async (job) => ({ words: String(job.input.text).split(/\s+/).length }));
 *     worker.handler("convert-audio", async (job) => { job.progress({ percent: 50 }); job.check(); return { path } },
 *                    { long: true });   // answers 202, heartbeats, completes by calling back
 *     await worker.listen(7000);
 *
 * A handler returns the result (any JSON value) or throws one of the errors of `errors.ts`;
 * any other exception is a retryable failure. Calls not signed with the secret are refused
 * (401). A `long` handler's call is answered `202` at once; heartbeats carry its latest
 * progress, and its result or error is sent to `complete_url`, signed, retried until jobfold
 * answers.
 */
import * as http from "node:http";
import type { AddressInfo } from "node:net";

import { JobError, Stop } from "./errors.js";
import * as signature from "./signature.js";

export type PreviousOutcome = "none" | "failed" | "ambiguous";

/** One attempt of a job, as jobfold sent it. */
export class Job {
  readonly id: string;
  readonly kind: string;
  readonly documentId: string;
  readonly inputVersion: number;
  readonly input: any;
  readonly attempt: number;
  readonly maxAttempts: number;
  /** Whether the last attempt's effects may have happened (`ambiguous`): reconcile first. */
  readonly previousOutcome: PreviousOutcome;
  readonly generation: number;
  readonly deadline: string | null;
  readonly heartbeatUrl?: string;
  readonly completeUrl?: string;
  /** The same for every attempt at this input version: pass it to what you change outside. */
  readonly idempotencyKey: string;
  readonly traceparent?: string;
  /** Aborted once jobfold answered a heartbeat with 409: lease lost, cancelled or ended. */
  readonly signal: AbortSignal;
  private readonly controller = new AbortController();
  private latest: unknown = undefined;

  constructor(body: any, headers: http.IncomingHttpHeaders) {
    for (const field of ["job_id", "kind", "document_id", "input_version", "generation"]) {
      if (body?.[field] === undefined) throw new TypeError(`the job has no ${field}`);
    }
    this.id = body.job_id;
    this.kind = body.kind;
    this.documentId = body.document_id;
    this.inputVersion = body.input_version;
    this.input = body.input;
    this.attempt = body.attempt ?? 1;
    this.maxAttempts = body.max_attempts ?? this.attempt;
    this.previousOutcome = body.previous_outcome ?? "none";
    this.generation = body.generation;
    this.deadline = body.deadline ?? null;
    this.heartbeatUrl = body.heartbeat_url;
    this.completeUrl = body.complete_url;
    const key = headers["idempotency-key"];
    this.idempotencyKey = (Array.isArray(key) ? key[0] : key) ?? `${this.id}:${this.inputVersion}`;
    const trace = headers["traceparent"];
    this.traceparent = Array.isArray(trace) ? trace[0] : trace;
    this.signal = this.controller.signal;
  }

  get lastAttempt(): boolean {
    return this.attempt >= this.maxAttempts;
  }

  get outcomeUnknown(): boolean {
    return this.previousOutcome === "ambiguous";
  }

  /** What the next heartbeat reports (any JSON value up to 16 KiB). */
  progress(value: unknown): void {
    this.latest = value;
  }

  /** Throws Stop once jobfold said to stop working on this attempt. */
  check(): void {
    if (this.signal.aborted) throw new Stop("jobfold said to stop: the lease was lost, or the job cancelled or ended");
  }

  /** @internal */
  takeProgress(): unknown {
    return this.latest;
  }

  /** @internal */
  stop(): void {
    this.controller.abort();
  }
}

export type HandlerFn = (job: Job) => unknown | Promise<unknown>;

export interface WorkerOptions {
  secret?: string;
  /** Seconds between a long job's heartbeats (keep it under the kind's callback_timeout). */
  heartbeatEvery?: number;
  tolerance?: number;
  maxBody?: number;
  /** Seconds one callback may take. */
  callbackTimeout?: number;
}

export interface Answer {
  status: number;
  headers: Record<string, string>;
  body: unknown;
}

function answer(status: number, body: unknown, retryAfter?: number): Answer {
  const headers: Record<string, string> = { "content-type": "application/json" };
  if (retryAfter !== undefined) headers["retry-after"] = String(Math.max(0, Math.ceil(retryAfter)));
  return { status, headers, body };
}

function failure(error: unknown): Answer {
  if (error instanceof JobError) return answer(error.status, { error: error.message }, error.retryAfter);
  return answer(500, { error: error instanceof Error ? `${error.name}: ${error.message}` : String(error) });
}

function outcomeOf(error: unknown): { status: number; message: string; retry_after?: number } {
  if (error instanceof JobError) {
    const retry = error.retryAfter === undefined ? undefined : Math.max(0, Math.ceil(error.retryAfter));
    return { status: error.status, message: error.message, ...(retry === undefined ? {} : { retry_after: retry }) };
  }
  return { status: 500, message: error instanceof Error ? `${error.name}: ${error.message}` : String(error) };
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

export class Worker {
  private readonly handlers = new Map<string, { fn: HandlerFn; long: boolean }>();
  readonly secret?: string;
  readonly heartbeatEvery: number;
  readonly tolerance: number;
  readonly maxBody: number;
  readonly callbackTimeout: number;

  constructor(options: WorkerOptions = {}) {
    this.secret = options.secret;
    this.heartbeatEvery = options.heartbeatEvery ?? 10;
    this.tolerance = options.tolerance ?? signature.TOLERANCE;
    this.maxBody = options.maxBody ?? 8 << 20;
    this.callbackTimeout = options.callbackTimeout ?? 10;
  }

  /** Runs jobs of `kind` with `fn`; `long`: answer 202 and call back. */
  handler(kind: string, fn: HandlerFn, options: { long?: boolean } = {}): this {
    this.handlers.set(kind, { fn, long: options.long ?? false });
    return this;
  }

  /** Answers one call: its headers and raw body. */
  async handle(headers: http.IncomingHttpHeaders, body: Buffer): Promise<Answer> {
    if (body.length > this.maxBody) return answer(413, { error: "the job is larger than this worker takes" });
    if (this.secret !== undefined) {
      const header = headers[signature.HEADER];
      try {
        signature.verify(this.secret, Array.isArray(header) ? header[0] : header, body, undefined, this.tolerance);
      } catch (e) {
        return answer(401, { error: (e as Error).message });
      }
    }
    let job: Job;
    try {
      job = new Job(JSON.parse(body.toString("utf8")), headers);
    } catch (e) {
      return answer(400, { error: `not a job: ${(e as Error).message}` });
    }
    const found = this.handlers.get(job.kind);
    if (!found) return answer(404, { error: `no handler for kind ${job.kind}` });
    if (found.long) return this.startLong(job, found.fn);
    try {
      return answer(200, (await found.fn(job)) ?? null);
    } catch (e) {
      return failure(e);
    }
  }

  private startLong(job: Job, fn: HandlerFn): Answer {
    if (!job.heartbeatUrl || !job.completeUrl) {
      return answer(400, { error: "a long handler needs the call's heartbeat_url and complete_url" });
    }
    void this.runLong(job, fn);
    return answer(202, { accepted: true });
  }

  private async runLong(job: Job, fn: HandlerFn): Promise<void> {
    const beats = setInterval(() => {
      void this.callBack(job.heartbeatUrl!, job, { progress: job.takeProgress() }).then(({ status }) => {
        if (status === 404 || status === 409) {
          job.stop();
          clearInterval(beats);
        }
      });
    }, this.heartbeatEvery * 1000);
    let outcome: Record<string, unknown>;
    try {
      outcome = { result: (await fn(job)) ?? null };
    } catch (e) {
      if (e instanceof Stop) {
        clearInterval(beats);
        return;
      }
      outcome = { error: outcomeOf(e) };
    }
    clearInterval(beats);
    if (job.signal.aborted) return;
    let delay = 500;
    const deadline = Date.now() + Math.max(this.callbackTimeout * 6, 60) * 1000;
    for (;;) {
      const { status } = await this.callBack(job.completeUrl!, job, outcome);
      if (status === 200 || (status >= 400 && status < 500) || Date.now() > deadline) return;
      await sleep(delay);
      delay = Math.min(delay * 2, 10_000);
    }
  }

  /** POSTs a callback for `job`, signed when the worker has a secret; status 0 when the connection failed. */
  async callBack(url: string, job: Job, fields: Record<string, unknown>): Promise<{ status: number; body: any }> {
    const payload: Record<string, unknown> = { kind: job.kind, generation: job.generation };
    for (const [k, v] of Object.entries(fields)) if (v !== undefined && v !== null) payload[k] = v;
    const body = JSON.stringify(payload);
    const headers: Record<string, string> = { "content-type": "application/json" };
    if (this.secret !== undefined) headers[signature.HEADER] = signature.sign(this.secret, body);
    try {
      const response = await fetch(url, {
        method: "POST",
        headers,
        body,
        signal: AbortSignal.timeout(this.callbackTimeout * 1000),
      });
      const text = await response.text();
      let parsed: any = null;
      try {
        parsed = text ? JSON.parse(text) : null;
      } catch {
        parsed = null;
      }
      return { status: response.status, body: parsed };
    } catch {
      return { status: 0, body: null };
    }
  }

  /** A `node:http` request listener. */
  get listener(): http.RequestListener {
    return (request, response) => {
      const send = ({ status, headers, body }: Answer) => {
        const bytes = Buffer.from(JSON.stringify(body));
        response.writeHead(status, { ...headers, "content-length": String(bytes.length) });
        response.end(bytes);
      };
      if (request.method !== "POST") return send(answer(405, { error: "POST a job" }));
      const chunks: Buffer[] = [];
      let size = 0;
      request.on("data", (chunk: Buffer) => {
        size += chunk.length;
        if (size <= this.maxBody) chunks.push(chunk);
      });
      request.on("end", () => {
        if (size > this.maxBody) return send(answer(413, { error: "the job is larger than this worker takes" }));
        this.handle(request.headers, Buffer.concat(chunks)).then(send, (e) => send(failure(e)));
      });
    };
  }

  /** Listens on `port` (0: a free one) of `host`; resolves with the server once it listens. */
  listen(port: number, host = "127.0.0.1"): Promise<http.Server> {
    const server = http.createServer(this.listener);
    server.keepAliveTimeout = 75_000;
    return new Promise((resolve) => server.listen(port, host, () => resolve(server)));
  }
}

/** The port a listening server took. */
export function portOf(server: http.Server): number {
  return (server.address() as AddressInfo).port;
}
