//! Fuzz target: arbitrary text as an XML document for parse_xml.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice_runtime::fuzz::xml_document(data));
