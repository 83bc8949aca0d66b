"""A one-machine Slurm cluster for tests: munged, slurmctld and slurmd on
loopback with every path (state, spool, logs, pid files, munge socket and key)
under one temporary directory, stopped by their PIDs on exit.

    with LocalSlurm() as cluster:
        subprocess.run(["sbatch", "--wait", ...], env=cluster.env)

Needs root and Debian's ``slurm-wlm`` (installed on demand by
:func:`ensure_installed`).
"""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

PACKAGES = ["slurm-wlm", "libpmix2", "libpmix-dev"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "srun"]


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
    def __init__(self, partition_oversubscribe=4):
        self.tmp = tempfile.mkdtemp(prefix="hpccomm-slurm-")
        self.procs = []
        self.oversubscribe = partition_oversubscribe
        self.env = dict(os.environ)

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)

    def _start(self, cmd, log):
        out = open(self.path(log), "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def start(self, timeout=90):
        for d in ("state", "spool", "munge"):
            os.makedirs(self.path(d))
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
        host = socket.gethostname()
        node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout
        node_line = next(line for line in node.splitlines() if line.startswith("NodeName="))
        conf = self.path("slurm.conf")
        with open(conf, "w") as f:
            f.write(f"""ClusterName=hpccomm-test
SlurmctldHost={host}(127.0.0.1)
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
SlurmdSpoolDir={self.path('spool')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd.pid')}
SlurmctldLogFile={self.path('slurmctld.log')}
SlurmdLogFile={self.path('slurmd.log')}
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
FirstJobId={_first_job_id()}
{node_line}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:{self.oversubscribe}
""")
        self.env["SLURM_CONF"] = conf
        self._wait_for(lambda: os.path.exists(sock), timeout, "munged socket")
        self._start(["slurmctld", "-D", "-i", "-f", conf], "slurmctld.out")
        self._start(["slurmd", "-D", "-f", conf], "slurmd.out")

        def node_idle():
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                 env=self.env).stdout.split()
            return "idle" in out

        self._wait_for(node_idle, timeout, "an idle node in sinfo")
        return self

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
        for name in ("slurmctld.log", "slurmd.log", "munged.out", "slurmctld.out", "slurmd.out"):
            p = self.path(name)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    out.append(f"--- {name} ---\n{f.read()[-3000:]}")
        return "\n".join(out)

    def stop(self):
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
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
