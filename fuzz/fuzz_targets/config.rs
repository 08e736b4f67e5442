#![no_main]
//! Fuzzes `baleen_tests::fuzz::config`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::config(data));
