//! jobfold's event contract: the Avro schemas under `schemas/*.avsc`, the Rust types that
//! mirror them, the pure `fold` that defines the job state machine, and the Confluent wire
//! codec. No I/O happens here except the codec's schema-registry calls.
