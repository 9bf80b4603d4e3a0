//! Fuzz target: arbitrary bytes as a workflow definition.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice_compiler::fuzz::workflow_definition(data));
