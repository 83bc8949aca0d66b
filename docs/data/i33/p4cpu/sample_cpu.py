"""Samples the machine's CPU accounting (the ``cpu`` line of /proc/stat, in
seconds: user, nice, system, idle, iowait, irq, softirq, steal) every
INTERVAL seconds, each line stamped with ``time.perf_counter()`` (the
CLOCK_MONOTONIC that ``bench allreduce``'s ``clock_start`` is read on), until
it is terminated.

    python sample_cpu.py OUT.tsv [INTERVAL]
"""
import os
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
out = open(sys.argv[1], "w", encoding="utf-8")
interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
out.write("t\tuser\tnice\tsystem\tidle\tiowait\tirq\tsoftirq\tsteal\n")
try:
    while True:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:9]
        out.write(f"{time.perf_counter():.6f}\t" + "\t".join(f"{int(v) / TICK:.2f}" for v in fields)
                  + "\n")
        time.sleep(interval)
finally:
    out.close()
