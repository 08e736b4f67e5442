#![no_main]
//! Fuzzes `baleen_tests::fuzz::proc_cgroup`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| baleen_tests::fuzz::proc_cgroup(data));
