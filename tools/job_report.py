#!/usr/bin/env python
"""The end of a job script's run (submissions/plumbing.sh): the last epoch of each run folder given,
with speedup and efficiency against a 1-rank run among them.

    python tools/job_report.py RUN_DIR [RUN_DIR ...]
"""
import json
import os
import sys

rows = []
for d in sys.argv[1:]:
    try:
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows.append((d, [json.loads(line) for line in f if line.strip()][-1]))
    except (OSError, IndexError, ValueError):
        rows.append((d, None))
base = next((m["samples_per_s"] for _, m in rows if m and m["world_size"] == 1), None)
cols = "" if base is None else f" {'speedup':>8} {'efficiency':>10}"
print(f"{'ranks':>5} {'samples/s':>10}{cols} {'test_acc':>8}  log dir")
for d, m in rows:
    if m is None:
        print(f"{'?':>5} {'-':>10}{' ' * len(cols)} {'-':>8}  {d} (no metrics: see output.log)")
        continue
    up = None if base is None else m["samples_per_s"] / base
    vs = "" if up is None else f" {up:>8.2f} {up / m['world_size']:>10.0%}"
    print(f"{m['world_size']:>5} {m['samples_per_s']:>10.0f}{vs} {m['test_acc']:>8.4f}  {d}")
if base is None:
    print("(speedup and efficiency need a 1-rank run to compare with: scale.sh makes one)")
