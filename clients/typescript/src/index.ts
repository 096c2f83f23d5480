/** jobfold for Node: handlers over jobfold's HTTP protocol, and a submit client. */
export { Client, TERMINAL } from "./client.js";
export type { SubmitOptions } from "./client.js";
export { ApiError, InvalidInput, JobError, Permanent, Retryable, Snooze, Stop, Throttled } from "./errors.js";
export { HEADER, SignatureError, sign, verify } from "./signature.js";
export { Job, Worker, portOf } from "./worker.js";
export type { Answer, HandlerFn, PreviousOutcome, WorkerOptions } from "./worker.js";
