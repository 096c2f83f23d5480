//! Every end-to-end test, one module a subject, compiled as one binary (see Cargo.toml).
//! `cargo nextest run -p jobfold-tests -E 'test(/^relay::/)'` runs one subject.

mod accept;
mod access;
mod bench;
mod boundary;
mod callbacks;
mod campaign;
mod capacity;
mod clients;
mod codec;
mod console;
mod demo;
mod examples;
mod intake;
mod layout;
mod observability;
mod openapi;
mod operations;
mod postgres;
mod processor;
mod quota;
mod registry;
mod relay;
mod replay;
mod smoke;
