#![no_main]
//! Fuzzes `baleen_tests::fuzz::admission_review`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::admission_review(data));
