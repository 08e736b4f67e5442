#![no_main]
//! Fuzzes `baleen_tests::fuzz::mps_log`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::mps_log(data));
