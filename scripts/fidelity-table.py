#!/usr/bin/env python3
"""Replays every Alibaba task list with baleen-sim and prints a Markdown table of unallocated
GPU % at arrived = 100 % (mean over seeds), ours beside the published results of the FGD
paper's artifact (read from ../shared/traces/alibaba-gpu-v2023/expected_results/).

Usage: cargo build --release -p baleen-scheduler-sim
       python3 scripts/fidelity-table.py [--seeds 42..51] [--policy all] [--trace DIR] > table.md
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

POLICY_COLUMNS = {
    "random": "01-Random",
    "dotprod": "02-DotProd",
    "gpu-clustering": "03-GpuClustering",
    "gpu-packing": "04-GpuPacking",
    "best-fit": "05-BestFit",
    "fgd": "06-FGD",
}


def quality_table(rows):
    """Markdown for --quality: baleen beside our fgd and the published fgd."""
    out = ["| workload | baleen | fgd (ours) | fgd (published) | baleen - published fgd |",
           "|---|---|---|---|---|"]
    for w, res, pub in rows:
        b = res["baleen"]["unallocated_pct_at_100"]
        f = res["fgd"]["unallocated_pct_at_100"]
        p = pub.get((w, "06-FGD"))
        if p:
            pm = statistics.mean(p)
            out.append(f"| {w} | {b['mean']:.2f} ± {b['sd']:.2f} | {f['mean']:.2f} ± {f['sd']:.2f} | {pm:.2f} | {b['mean'] - pm:+.2f} |")
        else:
            out.append(f"| {w} | {b['mean']:.2f} ± {b['sd']:.2f} | {f['mean']:.2f} ± {f['sd']:.2f} | – | – |")
    return "\n".join(out)


def published(trace_dir):
    """{(workload, artifact policy): [unallocated % at 100 per seed]}"""
    out = {}
    path = os.path.join(trace_dir, "expected_results", "analysis_allo_discrete.csv")
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = (row["workload"].removeprefix("openb_pod_list_"), row["sc_policy"])
            out.setdefault(key, []).append(100.0 - float(row["100"]))
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="42..51")
    ap.add_argument("--policy", default="all")
    ap.add_argument("--trace", default=os.path.join(root, "..", "shared", "traces", "alibaba-gpu-v2023"))
    ap.add_argument("--sim", default=os.path.join(root, "target", "release", "baleen-sim"))
    ap.add_argument("--extra", default="", help="extra arguments for baleen-sim")
    ap.add_argument("--quality", action="store_true",
                    help="run baleen and fgd and print baleen beside our and the published fgd")
    args = ap.parse_args()
    pub = published(args.trace)
    workloads = sorted(
        f.removeprefix("openb_pod_list_").removesuffix(".csv")
        for f in os.listdir(args.trace)
        if f.startswith("openb_pod_list_")
    )
    # Published workloads first, in the paper's order, then the rest.
    order = ["default", "cpu050", "cpu100", "cpu200", "cpu250", "gpushare40", "gpushare60",
             "gpushare80", "gpushare100", "multigpu20", "multigpu30", "multigpu40", "multigpu50",
             "gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33"]
    workloads = [w for w in order if w in workloads] + [w for w in workloads if w not in order]
    if args.quality:
        args.policy = "fgd,baleen"
    rows = []
    quality_rows = []
    policies = None
    for w in workloads:
        cmd = [args.sim, "--nodes", os.path.join(args.trace, "openb_node_list_gpu_node.csv"),
               "--pods", os.path.join(args.trace, f"openb_pod_list_{w}.csv"),
               "--policy", args.policy, "--seeds", args.seeds, "--json"] + args.extra.split()
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{' '.join(cmd)}: exit {res.returncode}: {res.stderr}")
        results = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
        quality_rows.append((w, {r["policy"]: r for r in results}, pub))
        policies = [r["policy"] for r in results]
        cells = []
        for r in results:
            ours = r["unallocated_pct_at_100"]
            theirs = pub.get((w, POLICY_COLUMNS.get(r["policy"], "")))
            if theirs:
                p = statistics.mean(theirs)
                cells.append(f"{ours['mean']:.2f} / {p:.2f} ({ours['mean'] - p:+.2f})")
            else:
                cells.append(f"{ours['mean']:.2f} / –")
        rows.append((w, cells))
        print(f"{w}: done", file=sys.stderr)
    if args.quality:
        print(quality_table(quality_rows))
        return
    print("| workload | " + " | ".join(policies) + " |")
    print("|---|" + "---|" * len(policies))
    for w, cells in rows:
        print(f"| {w} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
