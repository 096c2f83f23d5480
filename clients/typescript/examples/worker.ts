// A worker on the jobfold library: `count-words` answers at once, `transcode` is a long job
// (answers 202, heartbeats its progress, completes by calling back).
//
//     JOBFOLD_SECRET=... node dist/examples/worker.js --port 7000
//
// The first line printed is the port it listens on (--port 0 takes a free one).
import { InvalidInput, Worker, portOf } from "../src/index.js";

const worker = new Worker({
  secret: process.env.JOBFOLD_SECRET,
  heartbeatEvery: Number(process.env.JOBFOLD_HEARTBEAT_EVERY ?? "10"),
});

worker.handler("count-words", (job) => {
  if (typeof job.input?.text !== "string") throw new InvalidInput("input.text must be a string");
  return { words: job.input.text.split(/\s+/).filter(Boolean).length, attempt: job.attempt };
});

worker.handler(
  "transcode",
  async (job) => {
    const started = Date.now();
    const seconds = Number(job.input?.seconds ?? 60);
    while (Date.now() - started < seconds * 1000) {
      job.check(); // throws Stop once jobfold says the job is cancelled or the lease lost
      job.progress({ done: Math.round(((Date.now() - started) / (seconds * 1000)) * 1000) / 1000 });
      await new Promise((resolve) => setTimeout(resolve, Math.min(500, seconds * 1000)));
    }
    return { seconds: Math.round((Date.now() - started) / 100) / 10, source: job.input?.source };
  },
  { long: true },
);

const at = process.argv.indexOf("--port");
const server = await worker.listen(at > 0 ? Number(process.argv[at + 1]) : 7000);
console.log(portOf(server));
