/**
 * Signed calls: `Jobfold-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`,
 * the scheme of Stripe's and GitHub's webhooks. The receiver recomputes the MAC over the
 * timestamp and the raw body, compares in constant time, and refuses a timestamp more than
 * `tolerance` seconds from its clock.
 */
import { createHmac, timingSafeEqual } from "node:crypto";

export const HEADER = "jobfold-signature";
export const TOLERANCE = 300;

export class SignatureError extends Error {
  override name = "SignatureError";
}

function mac(secret: string | Buffer, at: number, body: Buffer | string): string {
  return createHmac("sha256", secret).update(`${at}.`).update(body).digest("hex");
}

/** The header value signing `body` at `at` (unix seconds; now if absent). */
export function sign(secret: string | Buffer, body: Buffer | string, at?: number): string {
  const t = at ?? Math.floor(Date.now() / 1000);
  return `t=${t},v1=${mac(secret, t, body)}`;
}

/** Throws SignatureError unless `header` signs `body` with `secret` within `tolerance`. */
export function verify(
  secret: string | Buffer,
  header: string | undefined | null,
  body: Buffer | string,
  now: number = Math.floor(Date.now() / 1000),
  tolerance: number = TOLERANCE,
): void {
  if (!header) throw new SignatureError("the call is not signed: it needs the header Jobfold-Signature");
  if (header.length > 1024) throw new SignatureError("the Jobfold-Signature header is malformed");
  let at: number | undefined;
  const signatures: string[] = [];
  for (const part of header.split(",")) {
    const eq = part.indexOf("=");
    if (eq < 0) throw new SignatureError("the Jobfold-Signature header is malformed");
    const name = part.slice(0, eq).trim();
    const value = part.slice(eq + 1).trim();
    if (name === "t" && at === undefined) {
      if (!/^-?\d+$/.test(value)) throw new SignatureError("the Jobfold-Signature header is malformed");
      at = Number(value);
    } else if (name === "v1") {
      signatures.push(value);
    }
  }
  if (at === undefined || signatures.length === 0) {
    throw new SignatureError("the Jobfold-Signature header is malformed: t=<unix seconds>,v1=<hex>");
  }
  if (Math.abs(now - at) > tolerance) {
    throw new SignatureError(`the signature's time is ${now - at} s away from this clock, more than ${tolerance} s`);
  }
  const expected = Buffer.from(mac(secret, at, body), "hex");
  const matches = signatures.some((s) => {
    const given = /^[0-9a-f]+$/i.test(s) ? Buffer.from(s, "hex") : Buffer.alloc(0);
    return given.length === expected.length && timingSafeEqual(given, expected);
  });
  if (!matches) throw new SignatureError("the signature does not match the body: another secret, or a changed body");
}
