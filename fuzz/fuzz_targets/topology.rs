#![no_main]
//! Fuzzes `baleen_tests::fuzz::topology`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::topology(data));
