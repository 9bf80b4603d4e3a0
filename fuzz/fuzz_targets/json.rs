//! Fuzz target: arbitrary bytes as a request body (parse, write back, XML).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice_runtime::fuzz::json_body(data));
