// Submits jobs with the jobfold client and waits for each; prints one JSON line a job.
//
//     node dist/examples/submit.js --api http://127.0.0.1:8080 --job count-words '{"text": "a b"}'
import { Client } from "../src/index.js";

const args = process.argv.slice(2);
let api = "";
let timeout = 600;
const jobs: [string, unknown][] = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--api") api = args[++i];
  else if (args[i] === "--timeout") timeout = Number(args[++i]);
  else if (args[i] === "--job") {
    jobs.push([args[i + 1], JSON.parse(args[i + 2])]);
    i += 2;
  } else throw new Error(`unknown argument ${args[i]}`);
}
const client = new Client(api, { token: process.env.JOBFOLD_TOKEN });
const submitted = [];
for (const [n, [kind, input]] of jobs.entries()) submitted.push([kind, await client.submit(kind, `doc-${n}`, input)] as const);
for (const [kind, accepted] of submitted) {
  const job = await client.wait(accepted.job_id, timeout);
  const result = job.state === "succeeded" ? await client.result(job.job_id) : null;
  console.log(JSON.stringify({ kind, job_id: job.job_id, state: job.state, attempt: job.attempt, result }));
}
