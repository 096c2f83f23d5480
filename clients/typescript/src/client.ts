/**
 * Submitting jobs to jobfold over HTTP, safely retried.
 *
 *     const client = new Client("http://127.0.0.1:8080", { token: process.env.JOBFOLD_TOKEN });
 *     const { job_id } = await client.submit("count-words", "doc-1", { text: "three little words" });
 *     const job = await client.wait(job_id);        // { state: "succeeded", ... }
 *
 * Every submit carries an idempotency key (yours, or one made for the call): a submit that
 * fails on the way (a lost connection, a 5xx) is sent again with the same key, so the job is
 * accepted once.
 */
import { randomUUID } from "node:crypto";

import { ApiError } from "./errors.js";

export const TERMINAL = ["succeeded", "quarantined", "superseded", "cancelled"];

export interface SubmitOptions {
  inputVersion?: number;
  idempotencyKey?: string;
  runAt?: string;
  delay?: string;
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

export class Client {
  readonly baseUrl: string;
  readonly token?: string;
  readonly timeout: number;
  readonly retries: number;

  constructor(baseUrl: string, options: { token?: string; timeout?: number; retries?: number } = {}) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.token = options.token;
    this.timeout = options.timeout ?? 10;
    this.retries = options.retries ?? 3;
  }

  private async request(method: string, path: string, body?: unknown, retry = false): Promise<any> {
    const headers: Record<string, string> = { accept: "application/json" };
    if (body !== undefined) headers["content-type"] = "application/json";
    if (this.token) headers.authorization = `Bearer ${this.token}`;
    let delay = 200;
    for (let attempt = 0; ; attempt++) {
      const last = !retry || attempt >= this.retries;
      let response: Response;
      try {
        response = await fetch(this.baseUrl + path, {
          method,
          headers,
          body: body === undefined ? undefined : JSON.stringify(body),
          signal: AbortSignal.timeout(this.timeout * 1000),
        });
      } catch (e) {
        if (last) throw new ApiError(0, "unreachable", `${method} ${path}: ${(e as Error).message}`);
        await sleep(delay);
        delay *= 2;
        continue;
      }
      const text = await response.text();
      let said: any = null;
      try {
        said = text ? JSON.parse(text) : null;
      } catch {
        said = null;
      }
      if (response.ok) return said;
      if (!last && response.status >= 500) {
        await sleep(delay);
        delay *= 2;
        continue;
      }
      const error = said?.error && typeof said.error === "object" ? said.error : {};
      throw new ApiError(response.status, error.code ?? "http_error", error.message ?? text, said);
    }
  }

  /** Accepts a job: `{ job_id, created }`. Retried with the same idempotency key. */
  submit(kind: string, documentId: string, input: unknown, options: SubmitOptions = {}): Promise<{ job_id: string; created: boolean }> {
    const body: Record<string, unknown> = {
      kind,
      document_id: documentId,
      input_version: options.inputVersion ?? 1,
      input,
      idempotency_key: options.idempotencyKey ?? randomUUID(),
    };
    if (options.runAt !== undefined) body.run_at = options.runAt;
    if (options.delay !== undefined) body.delay = options.delay;
    return this.request("POST", "/v1/jobs", body, true);
  }

  job(jobId: string): Promise<any> {
    return this.request("GET", `/v1/jobs/${encodeURIComponent(jobId)}`);
  }

  result(jobId: string): Promise<any> {
    return this.request("GET", `/v1/jobs/${encodeURIComponent(jobId)}/result`);
  }

  cancel(jobId: string, reason?: string): Promise<any> {
    return this.request("POST", `/v1/jobs/${encodeURIComponent(jobId)}/cancel`, reason ? { reason } : {});
  }

  /** The job once it ended (succeeded, quarantined, superseded, cancelled). */
  async wait(jobId: string, timeout = 60, poll = 0.2): Promise<any> {
    const deadline = Date.now() + timeout * 1000;
    for (;;) {
      const job = await this.job(jobId);
      if (TERMINAL.includes(job.state)) return job;
      if (Date.now() > deadline) throw new Error(`job ${jobId} is still ${job.state} after ${timeout} s`);
      await sleep(poll * 1000);
    }
  }
}
