"""The CPU accounting sampled beside run.sh's runs, per case: over each
case's timed iterations (its ``span`` on the run's ``clock_start``), the
CPU-seconds per call spent in user space (kernels, Python; on shared memory
also MPI's polling), in the kernel's system calls (over TCP: the sockets'
copies and MPICH's polling), in soft interrupts (the emulated network: veth,
bridge, tbf, TCP), stolen by the hypervisor, and idle, all CPUs together.

Then a floor of this machine for the calls over the emulated links, next to
the report's (wire bytes / link rate and the kernels, overlapped by the
pipeline's segments, which counts the wire as taking no CPU): ``(U + N) /
cores``, the user-space CPU of the case's iterations (the ranks' kernels and
Python; MPICH's TCP polling shows as system time) and the soft interrupts
(the emulated network: veth, bridge, tbf, TCP) spread over the cores.  It
leaves out the system time (the sockets' copies, but also the polling) and
the steal time (CPU the hypervisor gave to other guests).  The shared-memory
run at P = 2 shows the same calls without a network.

    python cpu.py [DIR]          (default: burst-256kb/ next to this script)
"""
import bisect
import json
import os
import sys

import numpy as np

from hpccomm.bench.report import floor_seconds

d = (sys.argv[1] if len(sys.argv) > 1
     else os.path.join(os.path.dirname(os.path.abspath(__file__)), "burst-256kb"))
COLS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def load_stat(path):
    rows = [line.split("\t") for line in open(path, encoding="utf-8").read().splitlines()[1:]]
    t = np.array([float(r[0]) for r in rows])
    v = np.array([[float(x) for x in r[1:]] for r in rows])
    return t, v


def at(t, v, when):
    """The cumulative counters at ``when``, linear between samples."""
    i = min(max(bisect.bisect_left(t, when), 1), len(t) - 1)
    w = (when - t[i - 1]) / (t[i] - t[i - 1])
    return v[i - 1] + w * (v[i] - v[i - 1])


runs = {}
for run in ("shm-p2", "netem-1g-p2", "netem-1g-p4"):
    data = json.load(open(os.path.join(d, f"{run}.json"), encoding="utf-8"))
    t, v = load_stat(os.path.join(d, f"stat-{run}.tsv"))
    start = data["meta"]["clock_start"]
    cores = data["meta"]["cores"]
    runs[run] = {}
    print(f"**{run}** ({cores} CPUs; CPU-seconds per call over each case's timed iterations, "
          "barriers included)\n")
    print("| case | median | wall per iteration | user | system | softirq + irq | steal | idle |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in data["rows"]:
        a, b = start + r["span"][0], start + r["span"][1]
        used = (at(t, v, b) - at(t, v, a)) / r["iterations"]
        c = dict(zip(COLS, used))
        case = f"{r['codec_name']}+{r['algorithm_name']}" if r["codec_name"] != "-" else "MPI_Allreduce"
        runs[run][case] = (r, c)
        print(f"| {case} | {r['time_median'] * 1e3:.1f} ms | {(b - a) / r['iterations'] * 1e3:.1f} ms "
              f"| {(c['user'] + c['nice']) * 1e3:.1f} ms | {c['system'] * 1e3:.1f} ms "
              f"| {(c['softirq'] + c['irq']) * 1e3:.1f} ms | {c['steal'] * 1e3:.1f} ms "
              f"| {c['idle'] * 1e3:.1f} ms |")
    print()

print("**The emulated links against floors** (ms per call)\n")
print("| run | case | measured | report's floor | measured / it | user U | softirq N | system "
      "| steal | (U + N) / cores | measured / it |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for run in ("netem-1g-p2", "netem-1g-p4"):
    cores = 2
    for case, (r, c) in runs[run].items():
        if case in ("MPI_Allreduce", "none+mpi"):
            continue
        U, N = c["user"] + c["nice"], c["softirq"] + c["irq"]
        cpu_floor = (U + N) / cores
        wire_floor = floor_seconds(r, 1e9)
        m = r["time_median"]
        print(f"| {run} | {case} | {m * 1e3:.1f} | {wire_floor * 1e3:.1f} | {m / wire_floor:.2f} "
              f"| {U * 1e3:.1f} | {N * 1e3:.1f} | {c['system'] * 1e3:.1f} | {c['steal'] * 1e3:.1f} "
              f"| {cpu_floor * 1e3:.1f} | {m / cpu_floor:.2f} |")
