#![no_main]
//! Fuzzes `baleen_tests::fuzz::extender_request`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::extender_request(data));
