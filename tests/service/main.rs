//! Integration tests: the real server, started in-process on `127.0.0.1:0`,
//! driven over HTTP. One test binary (link time); one module per area.

mod admin;
mod authoring;
mod cli;
mod connectors_http;
mod connectors_io;
mod data;
mod edge;
mod governance;
mod kafka;
mod otel;
mod readme;
mod replicas;
mod support;
mod traces;
