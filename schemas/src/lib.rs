//! jobfold's event contract: the Avro schemas under `schemas/*.avsc`, the Rust types that
//! mirror them, the pure [`fold`] that defines the job state machine, and the Confluent wire
//! codec.
//!
//! # Layout
//! - [`event`]: [`JobEvent`] (topic `jobfold.job-events`) and [`JobRequest`] (topic
//!   `jobfold.job-requests`), their payloads, and their conversion to Avro values.
//! - [`fold`](mod@fold): [`JobState`], [`fold()`](fold::fold) and [`JobState::apply`] — the one
//!   definition of the state machine, used by the processor, replay and the property tests.
//! - [`codec`]: the Confluent wire format (magic byte, schema id, Avro body) against a
//!   schema registry, with [`DecodeError`] telling poison from what may heal.
//!
//! Only the codec does I/O (registry calls); events and the fold are pure.

pub mod codec;
pub mod event;
pub mod fold;

pub use codec::{Codec, DecodeError, Decoder, Record, RegistryAuth};
pub use event::{JobEvent, JobRequest, Payload};
pub use fold::{FoldError, JobState, Status};
