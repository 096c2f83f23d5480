//! Arbitrary bytes through the frame parser and the Avro decoder, for both contracts.
//! Every input must decode or fail with a `DecodeError`; a panic or abort is a bug.
#![no_main]

use jobfold_schemas::codec::{decode_body, split_frame};
use jobfold_schemas::event::{JOB_EVENT_SCHEMA, JOB_REQUEST_SCHEMA};
use jobfold_schemas::{JobEvent, JobRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((id, body)) = split_frame(data) {
        let _ = decode_body::<JobEvent>(id, &JOB_EVENT_SCHEMA, body);
        let _ = decode_body::<JobRequest>(id, &JOB_REQUEST_SCHEMA, body);
    }
});
