//! Signed calls between the processor and handlers over HTTP, for kinds with a `secret`.
//!
//! Every call to the handler, and every callback from it, carries
//! `Jobfold-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`: the
//! scheme Stripe's and GitHub's webhooks use. The receiver recomputes the MAC over the
//! timestamp and the raw body it got, compares in constant time, and refuses a timestamp
//! more than [`TOLERANCE`] away from its own clock: a captured call cannot be replayed
//! later, and one whose body was changed does not verify. Several `v1=` values are allowed
//! (a sender rotating its secret signs with both).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header a signed call carries.
pub const HEADER: &str = jobfold_handler::protocol::SIGNATURE;

/// How far a signature's timestamp may be from the receiver's clock.
pub const TOLERANCE: std::time::Duration = std::time::Duration::from_secs(300);

/// The longest signature header read; a longer one is malformed.
const MAX_HEADER_BYTES: usize = 1024;

/// Why a signed call is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the call is not signed: it needs the header Jobfold-Signature")]
    Missing,
    #[error("the Jobfold-Signature header is malformed: it must be t=<unix seconds>,v1=<hex>")]
    Malformed,
    #[error(
        "the signature's time is {0} s away from this clock, more than the {tolerance} s allowed",
        tolerance = TOLERANCE.as_secs()
    )]
    Stale(i64),
    #[error("the signature does not match the body: another secret, or a changed body")]
    Mismatch,
}

fn mac(secret: &[u8], at: i64, body: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(at.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The header value signing `body` at `at` (unix seconds).
pub fn sign(secret: &[u8], at: i64, body: &[u8]) -> String {
    format!("t={at},v1={}", hex::encode(mac(secret, at, body).finalize().into_bytes()))
}

/// [`sign`] at this instant.
pub fn sign_now(secret: &[u8], body: &[u8]) -> String {
    sign(secret, chrono::Utc::now().timestamp(), body)
}

/// Checks `header` (the `Jobfold-Signature` value, if any) against `body` at `now` (unix
/// seconds).
///
/// # Errors
/// [`Refused`]: missing, malformed, outside [`TOLERANCE`], or matching no `v1=` value.
pub fn verify(secret: &[u8], header: Option<&str>, body: &[u8], now: i64) -> Result<(), Refused> {
    let header = header.ok_or(Refused::Missing)?;
    if header.len() > MAX_HEADER_BYTES {
        return Err(Refused::Malformed);
    }
    let mut at = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", value)) if at.is_none() => {
                at = Some(value.parse::<i64>().map_err(|_| Refused::Malformed)?);
            }
            Some(("v1", value)) => {
                signatures.push(hex::decode(value).map_err(|_| Refused::Malformed)?);
            }
            // Other schemes a later version may add are skipped.
            Some((_, _)) => {}
            None => return Err(Refused::Malformed),
        }
    }
    let at = at.ok_or(Refused::Malformed)?;
    if signatures.is_empty() {
        return Err(Refused::Malformed);
    }
    let skew = now.saturating_sub(at);
    if skew.unsigned_abs() > TOLERANCE.as_secs() {
        return Err(Refused::Stale(skew));
    }
    let expected = mac(secret, at, body);
    if signatures.iter().any(|s| expected.clone().verify_slice(s).is_ok()) {
        Ok(())
    } else {
        Err(Refused::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"a-secret-of-at-least-32-bytes-000";

    #[test]
    fn a_signature_verifies_only_for_its_body_secret_and_time() {
        let body = br#"{"job_id":"x"}"#;
        let header = sign(SECRET, 1_700_000_000, body);
        assert!(header.starts_with("t=1700000000,v1="), "{header}");
        assert_eq!(verify(SECRET, Some(&header), body, 1_700_000_100), Ok(()));
        assert_eq!(verify(SECRET, Some(&header), b"{}", 1_700_000_100), Err(Refused::Mismatch));
        assert_eq!(
            verify(b"another-secret-of-32-bytes-000000", Some(&header), body, 1_700_000_000),
            Err(Refused::Mismatch)
        );
        assert_eq!(verify(SECRET, Some(&header), body, 1_700_000_301), Err(Refused::Stale(301)));
        assert_eq!(verify(SECRET, Some(&header), body, 1_699_999_000), Err(Refused::Stale(-1000)));
        assert_eq!(verify(SECRET, None, body, 1_700_000_000), Err(Refused::Missing));
        for bad in ["", "v1=00", "t=1700000000", "t=soon,v1=00", "t=1700000000,v1=zz", "junk"] {
            assert_eq!(verify(SECRET, Some(bad), body, 1_700_000_000), Err(Refused::Malformed));
        }
        // A rotating sender's two signatures: either may match.
        let rotated = format!("{header},v1={}", "00".repeat(32));
        assert_eq!(verify(SECRET, Some(&rotated), body, 1_700_000_000), Ok(()));
    }

    #[test]
    fn the_signature_is_hmac_sha256_of_the_time_a_dot_and_the_body() {
        // Against a digest computed independently:
        // printf '1700000000.{}' | openssl dgst -sha256 -hmac 'key'
        let header = sign(b"key", 1_700_000_000, b"{}");
        assert_eq!(
            header,
            "t=1700000000,v1=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
    }
}
