//! Fuzz target: arbitrary bytes as `[rule, data]` for JSONLogic.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice_compiler::fuzz::logic_rule(data));
