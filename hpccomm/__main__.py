"""``python -m hpccomm [info] [--json]``: what hpccomm sees on this machine.

Under mpiexec / srun every rank takes part and rank 0 prints: the facts every
rank shares once, then one block per host with what differs there, per rank
where ranks of the host differ (:mod:`hpccomm.info`).
"""
import argparse
import contextlib
import io
import json
import sys
import textwrap

from mpi4py import MPI

from . import __version__, info

WIDTH = 24      # the label column


def fmt(value) -> str:
    """One fact as text (lines after the first are indented by the caller)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, dict) and set(value) == {"value", "reason"}:
        return f"{fmt(value['value'])} ({value['reason']})"
    if isinstance(value, dict):     # the environment
        return " ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    if isinstance(value, list) and value and isinstance(value[0], dict):   # the GPUs
        return "\n".join(", ".join(f"{k} {fmt(v)}" for k, v in item.items()) for item in value)
    if isinstance(value, list):
        return textwrap.fill(", ".join(map(str, value)), 100 - WIDTH) or "none"
    return str(value)


def lines(facts: dict, indent: str = "  ") -> list:
    out = []
    for key, value in facts.items():
        text = fmt(value).splitlines() or [""]
        out.append(f"{indent}{key:<{WIDTH}}{text[0]}")
        out.extend(f"{indent}{'':<{WIDTH}}{line}" for line in text[1:])
    return out


def per_rank(rank: str, value) -> str:
    head = f"rank {rank}: "
    first, *rest = fmt(value).splitlines() or [""]
    return "\n".join([head + first] + [" " * len(head) + line for line in rest])


def render(report: dict) -> str:
    """The report of :func:`hpccomm.info.collect` as text."""
    hosts = report["hosts"]
    out = [f"hpccomm {report.get('hpccomm', __version__)}: {report['ranks']} "
           f"rank{'s' * (report['ranks'] > 1)} on {len(hosts)} host{'s' * (len(hosts) > 1)}"]
    out += lines({k: v for k, v in report.items() if k != "hosts"})
    for host in hosts:
        ranks = host["ranks"]
        out.append(f"host {host['host']}: {len(ranks)} rank{'s' * (len(ranks) > 1)} "
                   f"({', '.join(map(str, ranks))})")
        out += lines(host["facts"])
        for key, values in host["per_rank"].items():
            out += lines({key: "\n".join(per_rank(r, v) for r, v in values.items())})
        if not host["facts"] and not host["per_rank"]:
            out.append("  (every fact as above)")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpccomm",
        description="Print what hpccomm sees on this machine, for bug reports: versions, the "
                    "MPI library and thread level, whether MPI is CUDA-aware and why, GPUs, "
                    "threads per rank, the profile algorithm='auto' would load, the registered "
                    "codecs and algorithms. Under mpiexec/srun every rank takes part and rank 0 "
                    "prints one block per host.")
    parser.add_argument("command", nargs="?", default="info", choices=["info"],
                        help="what to do (default: info)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object instead: the facts every rank shares, the job's, "
                             "and 'hosts' (per host: 'ranks', 'facts' one-valued on the host, "
                             "'per_rank' {fact: {rank: value}})")
    parser.add_argument("--version", action="version", version=f"hpccomm {__version__}")
    rank = MPI.COMM_WORLD.Get_rank()
    quiet = contextlib.ExitStack()
    if rank > 0:        # every rank parses alike; rank 0 alone speaks (help, errors)
        quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
        quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
    with quiet:
        args = parser.parse_args(argv)
    report = info.collect(MPI.COMM_WORLD)
    if rank == 0:
        print(json.dumps(report, indent=1) if args.json else render(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
