#![no_main]
//! Fuzzes `baleen_tests::fuzz::checkpoint`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::checkpoint(data));
