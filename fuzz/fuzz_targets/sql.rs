//! Fuzz target: arbitrary text as a db_read and db_write statement.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice_compiler::fuzz::sql_statement(data));
