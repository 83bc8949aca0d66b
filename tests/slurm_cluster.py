"""Slurm clusters for tests, every path (state, spool, logs, pid files, munge
socket and key) under one temporary directory, every daemon stopped by its
process group on exit -- on success, on failure and on Ctrl-C.

``LocalSlurm``: one node -- munged, slurmctld and slurmd on loopback.
``NetnsSlurm``: several emulated hosts -- one network namespace per node, with
its own hostname and a ``tc tbf``-limited NIC on a bridge, built by
``hpccomm.bench netem``'s :class:`~hpccomm.bench.netem.Cluster`; a slurmd in
each node's namespace and slurmctld in one more (the head node, where jobs are
submitted from).  munged runs once, outside: its socket is a file, reachable
from every network namespace.

    with LocalSlurm() as cluster:
        subprocess.run(cluster.command(["sbatch", "--wait", ...]), env=cluster.env)

Needs root and Debian's ``slurm-wlm`` (installed on demand by
:func:`ensure_installed`).
"""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

from hpccomm.bench import netem

PACKAGES = ["slurm-wlm", "libpmix2", "libpmix-dev"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def missing_binaries():
    return [b for b in BINARIES if shutil.which(b) is None]


def ensure_installed(timeout=600):
    """Install Slurm from Debian's packages when missing.  Returns None when
    ready, else the reason it cannot be."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0:
        return "not root: cannot install slurm-wlm"
    if shutil.which("apt-get") is None:
        return "no apt-get to install slurm-wlm"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode != 0:
            return f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}"
    missing = missing_binaries()
    return f"still missing after install: {missing}" if missing else None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_job_id() -> int:
    """Job ids that do not repeat between test runs: a job aborted by MPI may
    leave MPICH shared-memory segments behind whose names derive from the
    job id, and a later job with the same id then fails in MPI_Init ("Out of
    memory" in the POSIX shm bootstrap)."""
    return 1000 + int(time.time() * 10) % 50_000_000


class LocalSlurm:
    """munged, slurmctld and one slurmd (this machine, on loopback)."""

    def __init__(self, partition_oversubscribe=4):
        self.tmp = tempfile.mkdtemp(prefix="hpccomm-slurm-")
        self.procs = []
        self.oversubscribe = partition_oversubscribe
        self.env = self._job_env()
        # jobs import the hpccomm under test (the repository, not an installed copy)
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

    def _job_env(self):
        """The environment of the daemons, client commands and (sbatch exports
        it) the jobs."""
        return dict(os.environ)

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)

    def command(self, argv):
        """``argv`` as run where jobs are submitted from (here: this machine)."""
        return list(argv)

    def _start(self, cmd, log):
        out = open(self.path(log), "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def _start_munged(self, timeout):
        os.makedirs(self.path("munge"))
        os.chmod(self.path("munge"), 0o700)
        key = self.path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = self.path("munge", "munge.sock")
        self._start(["munged", "--foreground", "--force", f"--socket={sock}",
                     f"--key-file={key}", f"--pid-file={self.path('munge', 'munged.pid')}",
                     f"--log-file={self.path('munge', 'munged.log')}",
                     f"--seed-file={self.path('munge', 'munged.seed')}"], "munged.out")
        self._wait_for(lambda: os.path.exists(sock), timeout, "munged socket")
        return sock

    def _hardware(self):
        """This machine's ``NodeName=...`` line from ``slurmd -C``, without the name."""
        out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True,
                             timeout=60).stdout
        line = next(line for line in out.splitlines() if line.startswith("NodeName="))
        return line.split(None, 1)[1]

    def _write_conf(self, sock, controller, nodes):
        """slurm.conf with ``SlurmctldHost=controller`` and one ``NodeName=``
        line per entry of ``nodes``; per-node files carry the node's name (%n)."""
        conf = self.path("slurm.conf")
        for line in nodes:
            os.makedirs(self.path("spool", line.split()[0][len("NodeName="):]))
        node_lines = "\n".join(nodes)
        with open(conf, "w") as f:
            f.write(f"""ClusterName=hpccomm-test
SlurmctldHost={controller}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool', '%n')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd-%n.pid')}
SlurmctldLogFile={self.path('slurmctld.log')}
SlurmdLogFile={self.path('slurmd-%n.log')}
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
FirstJobId={_first_job_id()}
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:{self.oversubscribe}
""")
        self.env["SLURM_CONF"] = conf
        return conf

    def start(self, timeout=90):
        os.makedirs(self.path("state"))
        sock = self._start_munged(timeout)
        host = socket.gethostname()
        conf = self._write_conf(sock, f"{host}(127.0.0.1)", [f"NodeName={host} {self._hardware()}"])
        self._start(["slurmctld", "-D", "-i", "-f", conf], "slurmctld.out")
        self._start(["slurmd", "-D", "-f", conf], "slurmd.out")
        self._wait_for(lambda: self.idle_nodes() >= 1, timeout, "an idle node in sinfo")
        return self

    def idle_nodes(self):
        """How many nodes ``sinfo`` reports idle."""
        try:
            out = subprocess.run(self.command(["sinfo", "-h", "-N", "-o", "%N %T"]),
                                 capture_output=True, text=True, env=self.env, timeout=30).stdout
        except subprocess.TimeoutExpired:
            return 0
        return sum(1 for line in out.splitlines() if line.split()[1:] == ["idle"])

    def _wait_for(self, predicate, timeout, what):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) while waiting "
                                       f"for {what}: {self.logs()}")
            if predicate():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")

    def logs(self):
        out = []
        names = sorted(n for n in os.listdir(self.tmp) if n.endswith((".log", ".out")))
        for name in names:
            with open(self.path(name), errors="replace") as f:
                out.append(f"--- {name} ---\n{f.read()[-3000:]}")
        return "\n".join(out)

    def stop(self):
        try:
            self._stop_daemons()
            self._release()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _release(self):
        """What else the cluster holds, released after the daemons stop."""

    def _stop_daemons(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()

    def __enter__(self):
        # SIGTERM (a CI runner's timeout) unwinds like Ctrl-C, through stop()
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc):
        try:
            self.stop()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def netns_problem():
    """Why :class:`NetnsSlurm` cannot run here (not root, ``ip``/``tc``/
    ``unshare``/``nsenter`` missing, the kernel lacks namespaces, veth, bridge
    or tbf), or None."""
    if shutil.which("nsenter") is None:
        return "no 'nsenter' (Debian: apt-get install util-linux)"
    return netem.missing_requirement() or netem.kernel_problem()


class NetnsSlurm(LocalSlurm):
    """``nodes`` emulated hosts ``node0``, ``node1``, ... (network namespaces
    on a bridge, NICs of ``rate`` in both directions) and a head node ``head``
    running slurmctld; jobs are submitted from the head node
    (:meth:`command`).  The namespaces' names start with a prefix of this run;
    ``stop()`` ends the daemons, then whatever still runs in the namespaces,
    then deletes exactly these namespaces.

    ``env`` carries what the MPICH wheel needs across the emulated hosts (TCP
    over each host's ``veth0``: :func:`hpccomm.bench.netem.launch_env`), and
    sbatch exports it to the jobs."""

    def __init__(self, nodes=2, rate="1gbit", partition_oversubscribe=4):
        self.nodes = nodes
        self.rate = rate
        # host i < nodes is node i; host `nodes` is the head node
        self.net = netem.Cluster(nodes + 1, rate, "per-host",
                                 prefix=f"hpccslurm{os.getpid() % 100000}")
        super().__init__(partition_oversubscribe)

    def _job_env(self):
        return netem.launch_env("per-host", "mpich", self.rate)

    @property
    def prefix(self):
        return self.net.prefix

    def node_name(self, i):
        return "head" if i == self.nodes else f"node{i}"

    def in_host(self, i, argv):
        """``argv`` run in host ``i``'s network namespace under its own
        hostname.  ``nsenter --net``, not ``ip netns exec``: the latter mounts
        a fresh /sys, without the cgroup file systems slurmd needs."""
        return ["nsenter", f"--net=/run/netns/{self.net.host_ns(i)}", "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.node_name(i), *argv]

    def command(self, argv):
        return self.in_host(self.nodes, argv)

    def start(self, timeout=90):
        os.makedirs(self.path("state"))
        self.net.build()
        sock = self._start_munged(timeout)
        hw = self._hardware()
        head = self.nodes
        conf = self._write_conf(
            sock, f"{self.node_name(head)}({self.net.addr(head)})",
            [f"NodeName={self.node_name(i)} NodeAddr={self.net.addr(i)} {hw}"
             for i in range(self.nodes)])
        self._start(self.in_host(head, ["slurmctld", "-D", "-i", "-f", conf]), "slurmctld.out")
        for i in range(self.nodes):
            self._start(self.in_host(i, ["slurmd", "-D", "-N", self.node_name(i), "-f", conf]),
                        f"slurmd-{self.node_name(i)}.out")
        self._wait_for(lambda: self.idle_nodes() == self.nodes, timeout,
                       f"{self.nodes} idle nodes in sinfo")
        return self

    def _release(self):
        self.net.close()
