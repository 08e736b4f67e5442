#!/usr/bin/env python3
"""Wall time, CPU time and peak RSS of one baleen-sim seed, two binaries alternated in one
sitting: how `docs/benchmarks.md`, "Replay speed (issue 10)", compares a build with an older one.

Each round runs `--policy P --seeds 42 --threads 1 --json` on the default task list for each
policy, the before binary then the after binary. Wall time is taken around fork, exec and wait;
CPU time and peak RSS come from the child's own resource usage (what `/usr/bin/time -v` reports
as "Maximum resident set size"). Prints medians and before/after ratios.

Usage: cargo build --release -p baleen-scheduler-sim
       python3 scripts/replay-speed.py BEFORE_BINARY [--after target/release/baleen-sim]
           [--rounds 9] [--policy fgd,baleen] [--trace ../shared/traces/alibaba-gpu-v2023]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def run(binary, trace, policy):
    """One seed of `policy`: (wall seconds, CPU seconds, peak RSS in MiB)."""
    args = [
        binary,
        "--nodes", os.path.join(trace, "openb_node_list_gpu_node.csv"),
        "--pods", os.path.join(trace, "openb_pod_list_default.csv"),
        "--policy", policy, "--seeds", "42", "--threads", "1", "--json",
    ]
    start = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        sys.exit(f"{binary} --policy {policy} failed (wait status {status})")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("--after", default="target/release/baleen-sim")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--policy", default="fgd,baleen")
    parser.add_argument("--trace", default="../shared/traces/alibaba-gpu-v2023")
    args = parser.parse_args()
    policies = args.policy.split(",")
    runs = {(p, b): [] for p in policies for b in ("before", "after")}
    for _ in range(args.rounds):
        for policy in policies:
            for which, binary in (("before", args.before), ("after", args.after)):
                runs[(policy, which)].append(run(binary, args.trace, policy))
    print("| policy | measure | before | after | before / after |")
    print("|---|---|---|---|---|")
    for policy in policies:
        for k, (name, unit, scale) in enumerate(
            (("wall time", "ms", 1000), ("CPU time", "ms", 1000), ("peak RSS", "MiB", 1))
        ):
            b = statistics.median(r[k] for r in runs[(policy, "before")]) * scale
            a = statistics.median(r[k] for r in runs[(policy, "after")]) * scale
            print(f"| {policy} | {name} | {b:.1f} {unit} | {a:.1f} {unit} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
