"""What hpccomm sees on this machine, for bug reports: ``python -m hpccomm``.

:func:`collect` (collective) gathers every rank's facts -- versions, the MPI
library and its thread level, whether MPI is CUDA-aware and why, the GPUs and
GPU packages, the kernels' thread count and why, the registered codecs and
algorithms -- adds the job's own (its size, the profile ``algorithm="auto"``
would load) and summarises them by host with :func:`summarise`: a fact with
one value on every rank is stated once, at the top; one with one value per
host is stated in that host's entry (``facts``); one that differs between
ranks of a host is stated per rank (``per_rank``).

Everything that may be missing or broken (numba-cuda, CuPy, torch, a GPU
driver) is imported here, lazily, and reported as ``"not installed"`` or as
its error in one line; nothing in hpccomm imports this module.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import warnings
from importlib import metadata
from typing import Any, Dict, List

import mpi4py
import numba
import numpy as np
from mpi4py import MPI

from . import __version__, cost_model
from .bench.harness import mpi_thread_level
from .buffers import mpi_cuda_support_reason
from .codecs import available_codecs
from .collectives import available_algorithms
from .collectives.auto import profile_location
from .communicators import ranks_on_node
from .kernels import threads

#: environment variables reported when set: these prefixes, and these names
ENV_PREFIXES = ("HPCCOMM_", "NUMBA_", "MPI4PY_")
ENV_NAMES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def one_line(exc: BaseException) -> str:
    """An exception as ``Type: message`` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _package(name: str) -> str:
    """The version of an optional package, ``"not installed"``, or the error
    importing it raised."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return "not installed"
        return f"error: {one_line(exc)}"
    except Exception as exc:  # noqa: BLE001 -- a broken install is a fact to report
        return f"error: {one_line(exc)}"
    return str(getattr(module, "__version__", "?"))


def _distribution(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpus() -> str:
    """This process's CPU affinity: ``count (ranges)``."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return str(os.cpu_count())
    runs = []                       # [first, last] of each run of consecutive CPUs
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{len(cpus)} ({text})"


def _requested_thread_level() -> Dict[str, str]:
    """The thread level mpi4py asked MPI for (hpccomm leaves mpi4py's choice)."""
    flag = os.environ.get("MPI4PY_RC_THREADS")
    if flag is not None and flag.strip().lower() in ("0", "false", "no", "off"):
        return {"value": "single", "reason": f"MPI4PY_RC_THREADS={flag}: MPI_Init"}
    if not mpi4py.rc.threads:
        return {"value": "single", "reason": "mpi4py.rc.threads = False: MPI_Init"}
    level = os.environ.get("MPI4PY_RC_THREAD_LEVEL")
    if level:
        return {"value": level.strip().lower(), "reason": "MPI4PY_RC_THREAD_LEVEL"}
    return {"value": mpi4py.rc.thread_level, "reason": "mpi4py.rc.thread_level"}


def _cuda() -> Dict[str, Any]:
    """numba-cuda, the simulator, the driver and the GPUs it lists."""
    out: Dict[str, Any] = {"numba_cuda": _distribution("numba-cuda"),
                           "cuda_simulator": bool(numba.config.ENABLE_CUDASIM),
                           "cuda_available": None, "cuda_driver": None, "gpus": []}
    try:
        from numba import cuda

        if not cuda.is_available():
            from numba.cuda.cudadrv.driver import driver

            reason = " ".join(str(getattr(driver, "initialization_error", "") or "").split())
            out["cuda_available"] = {"value": False, "reason": reason or "no CUDA device"}
            return out
        if out["cuda_simulator"]:
            out["cuda_available"] = {"value": True, "reason": "numba's CUDA simulator"}
        else:
            from numba.cuda.cudadrv.driver import driver

            out["cuda_available"] = {"value": True, "reason": "numba.cuda.is_available()"}
            out["cuda_driver"] = ".".join(str(v) for v in driver.get_version())
        out["gpus"] = [_gpu(dev, out["cuda_simulator"]) for dev in cuda.list_devices()]
    except Exception as exc:  # noqa: BLE001 -- a broken driver is a fact to report
        out["cuda_available"] = {"value": False, "reason": one_line(exc)}
    return out


def _gpu(dev, simulated: bool) -> Dict[str, Any]:
    """One device as numba lists it, without making a context on it."""
    name = getattr(dev, "name", None) or ("numba CUDA simulator" if simulated else "?")
    gpu = {"id": int(dev.id), "name": name.decode() if isinstance(name, bytes) else str(name),
           "compute_capability": ".".join(str(v) for v in dev.compute_capability),
           "memory_gib": None}
    if not simulated:
        try:
            from numba.cuda.cudadrv.driver import driver

            gpu["memory_gib"] = round(int(driver.cuDeviceTotalMem(dev.id)) / 2**30, 1)
        except Exception:  # noqa: BLE001 -- the memory is a detail; the rest stands
            pass
    return gpu


def _torch() -> Dict[str, Any]:
    version = _package("torch")
    out: Dict[str, Any] = {"torch": version, "torch_cuda": None}
    if version[:1].isdigit():
        try:
            import torch

            if torch.cuda.is_available():
                out["torch_cuda"] = {"value": True, "reason": f"{torch.cuda.device_count()} "
                                     f"GPUs, CUDA {torch.version.cuda}"}
            else:
                out["torch_cuda"] = {"value": False, "reason": "a build without CUDA"
                                     if torch.version.cuda is None else
                                     f"CUDA {torch.version.cuda} build, no GPU it can use"}
        except Exception as exc:  # noqa: BLE001
            out["torch_cuda"] = {"value": False, "reason": one_line(exc)}
    return out


def rank_facts(comm) -> Dict[str, Any]:
    """This rank's facts (collective: it asks which ranks share its node)."""
    local = ranks_on_node(comm)
    facts: Dict[str, Any] = {
        "host": MPI.Get_processor_name(),
        "hpccomm": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "numpy": np.__version__, "numba": numba.__version__, "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().strip(),
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "thread_level_requested": _requested_thread_level(),
        "thread_level_provided": mpi_thread_level(),
    }
    try:        # no rank may leave early: the others would wait for it in gather
        answer, reason = mpi_cuda_support_reason()
        facts["cuda_aware_mpi"] = {"value": answer, "reason": reason}
    except Exception as exc:  # noqa: BLE001
        facts["cuda_aware_mpi"] = {"value": None, "reason": one_line(exc)}
    facts.update(_cuda())
    facts["cupy"] = _package("cupy")
    facts.update(_torch())
    count, reason = threads.for_node(local)
    facts.update({
        "ranks_on_node": local,
        "cpus": _cpus(),
        "numba_threads": {"value": numba.get_num_threads(),
                          "reason": f"of NUMBA_NUM_THREADS = {numba.config.NUMBA_NUM_THREADS}"},
        "hpccomm_threads": {"value": count, "reason": reason},
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(ENV_PREFIXES) or k in ENV_NAMES},
        "codecs": list(available_codecs()),
        "algorithms": list(available_algorithms()),
    })
    return facts


def auto_profile(comm) -> Dict[str, Any]:
    """The profile ``algorithm="auto"`` on ``comm`` would load, as rank 0 reads
    it: its path, or ``"none"`` with where it was looked for (collective)."""
    path = profile_location(comm)
    if comm.Get_rank() != 0:
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile, source = cost_model.load(path)
    if source == "defaults":      # the warning says why the file was ignored
        return {"value": "none", "reason": str(caught[0].message) if caught else
                f"no file at {path}: the built-in defaults"}
    machine = profile.get("machine", {})
    return {"value": path,
            "reason": f"calibrated {profile.get('created', '?')}, {profile.get('mode', '?')} "
                      f"mode, P = {machine.get('ranks')}, {machine.get('mpi', '?')}"}


def _key(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def summarise(ranks: List[Dict[str, Any]], job: Dict[str, Any]) -> Dict[str, Any]:
    """One report from every rank's facts (in rank order, each with its
    ``host``) and the job's: the facts one-valued across all ranks and
    ``job`` at the top, then ``hosts`` -- one entry per host in order of its
    first rank: ``host``, ``ranks``, ``facts`` (one value on its ranks, not
    on all) and ``per_rank`` (``{fact: {rank: value}}``, the rest)."""
    fields = list(dict.fromkeys(k for r in ranks for k in r if k != "host"))
    common = {k: ranks[0].get(k) for k in fields
              if all(_key(r.get(k)) == _key(ranks[0].get(k)) for r in ranks)}
    by_host: Dict[str, List[int]] = {}
    for i, r in enumerate(ranks):
        by_host.setdefault(r["host"], []).append(i)
    hosts = []
    for host, members in by_host.items():
        entry = {"host": host, "ranks": members, "facts": {}, "per_rank": {}}
        for k in fields:
            if k in common:
                continue
            values = [ranks[i].get(k) for i in members]
            if all(_key(v) == _key(values[0]) for v in values):
                entry["facts"][k] = values[0]
            else:
                entry["per_rank"][k] = {str(i): v for i, v in zip(members, values)}
        hosts.append(entry)
    return {**common, **job, "hosts": hosts}


def collect(comm=None) -> Dict[str, Any]:
    """The report of :func:`summarise` over every rank of ``comm`` (default
    ``MPI.COMM_WORLD``), the same on every rank.  Collective; works on a
    private duplicate of ``comm``."""
    base = MPI.COMM_WORLD if comm is None else comm
    comm = base.Dup()
    try:
        facts = rank_facts(comm)
        job = {"ranks": comm.Get_size(), "auto_profile": auto_profile(comm)}
        gathered = comm.gather(facts, root=0)
        report = summarise(gathered, job) if comm.Get_rank() == 0 else None
        return comm.bcast(report, root=0)
    finally:
        comm.Free()
