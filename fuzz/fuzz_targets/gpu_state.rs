#![no_main]
//! Fuzzes `baleen_tests::fuzz::gpu_state`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::gpu_state(data));
