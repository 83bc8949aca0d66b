"""``python -m hpccomm.bench soak``: many calls, watching what hpccomm holds.

Run under mpiexec / srun.  ``--calls`` calls (default 10^5) over a fixed mix
of reducers (codec and algorithm), keys and sizes, drawn from ``--seed`` --
the same schedule on every rank:

* every reducer has four keys that keep coming back, of 257 to 16,384
  elements, and *transient* keys that appear, are called for a while and
  never return (a model whose shapes change): a new one every
  ``--transient-every`` calls of that reducer, the oldest of its four
  retired.  Half the reducers bound their keys (``max_keys=8``), the other
  half ``reset(key)`` each key they retire -- the two things a code whose
  keys come and go can do; ``--unbounded`` does neither, to show what then
  piles up;
* 30 % of the calls are started (``start()``), up to four in flight, the
  rest blocking;
* every reducer's ``state_dict()`` is taken every ``--state-every`` calls.

Every ``--sample`` calls (all started calls waited for first) each rank
records its resident memory (``/proc/self/statm``), the MPI objects hpccomm
holds (:mod:`hpccomm.handles`: communicators, datatypes, operations,
requests), the keys its reducers keep and their state's bytes (residuals and
spares), its open file descriptors and threads.  Rank 0 prints the samples
(the maximum over ranks) and the verdict (:func:`verdict`): the growth of
resident memory over the last 90 % of the run (target: below 1 %) and of
everything else (target: none); ``FLAT`` when both hold.  ``--json`` writes
every rank's samples.

    mpiexec -n 3 python -m hpccomm.bench soak --calls 100000 --json soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import deque
from typing import Dict, List

import numpy as np

#: the reducers of the mix: name and Allreducer options
MIX = [
    ("onebit/twoshot", {"codec": "onebit"}),
    ("qsgd/twoshot", {"codec": "qsgd"}),
    ("topk/allgather", {"codec": "topk", "algorithm": "allgather", "ratio": 0.05}),
    ("terngrad/summable", {"codec": "terngrad", "algorithm": "summable"}),
    ("topk/sparse_split", {"codec": "topk", "algorithm": "sparse_split", "ratio": 0.05}),
    ("none/mpi", {"codec": "none"}),
]
#: the sizes of keys (elements): awkward, up to 64 KiB of float32
SIZES = (257, 1000, 4097, 16384)
#: keys that keep coming back, per reducer
PERSISTENT = 4
#: transient keys alive at a time, per reducer
TRANSIENT = 4
#: share of calls that are started rather than blocking; most in flight
STARTED, IN_FLIGHT = 0.3, 4
#: resident memory may grow this much over the last 90 % of the run
RSS_GROWTH = 0.01


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=100_000, help="calls in all")
    p.add_argument("--sample", type=int, default=1000, help="calls between samples")
    p.add_argument("--state-every", type=int, default=10_000,
                   help="calls between state_dict() of every reducer")
    p.add_argument("--transient-every", type=int, default=50,
                   help="calls of a reducer between two of its new transient keys")
    p.add_argument("--transient-share", type=float, default=0.2,
                   help="share of a reducer's calls that go to its transient keys")
    p.add_argument("--unbounded", action="store_true",
                   help="neither max_keys nor reset(key): transient keys pile up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-J", "--json", default=None, help="write every rank's samples here")
    return p


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Soak:
    """The schedule and its reducers on one rank (every rank draws the same)."""

    def __init__(self, comm, args):
        import hpccomm

        self.comm, self.args = comm, args
        self.rank = comm.Get_rank()
        self.rng = np.random.default_rng(args.seed)          # the schedule: same on all ranks
        data_rng = np.random.default_rng([args.seed, self.rank])
        self.inputs = {n: data_rng.standard_normal(n).astype(np.float32) for n in SIZES}
        self.reducers = []
        for i, (name, options) in enumerate(MIX):
            bounded = i % 2 == 0 and not args.unbounded
            kw = dict(options, max_keys=PERSISTENT + TRANSIENT) if bounded else dict(options)
            self.reducers.append({
                "name": name, "reducer": hpccomm.Allreducer(comm, **kw), "bounded": bounded,
                "keys": {f"w{j}": SIZES[j % len(SIZES)] for j in range(PERSISTENT)},
                "transient": deque(), "serial": 0, "calls": 0})
        self.in_flight: deque = deque()

    def _transient_key(self, entry) -> str:
        """The key of a call to ``entry``'s transient keys: a new one every
        ``transient_every`` calls of the reducer, the oldest retired."""
        if not entry["transient"] or entry["calls"] % self.args.transient_every == 0:
            key = f"t{entry['serial']}"
            entry["keys"][key] = SIZES[entry["serial"] % len(SIZES)]   # a steady mix alive
            entry["transient"].append(key)
            entry["serial"] += 1
            if len(entry["transient"]) > TRANSIENT:
                old = entry["transient"].popleft()
                del entry["keys"][old]
                if not entry["bounded"] and not self.args.unbounded:
                    self.wait_all()
                    entry["reducer"].reset(old)
        return entry["transient"][int(self.rng.integers(len(entry["transient"])))]

    def call(self) -> None:
        entry = self.reducers[int(self.rng.integers(len(self.reducers)))]
        if self.rng.random() < self.args.transient_share:
            key = self._transient_key(entry)
        else:
            key = f"w{int(self.rng.integers(PERSISTENT))}"
        entry["calls"] += 1
        x = self.inputs[entry["keys"][key]]
        if self.rng.random() < STARTED:
            self.in_flight.append(entry["reducer"].start(x, key=key))
            if len(self.in_flight) > IN_FLIGHT:
                self.in_flight.popleft().wait()
        else:
            entry["reducer"](x, key=key)

    def wait_all(self) -> None:
        while self.in_flight:
            self.in_flight.popleft().wait()

    def state_dicts(self) -> None:
        for entry in self.reducers:
            entry["reducer"].state_dict()

    def sample(self, calls: int, t0: float) -> Dict[str, float]:
        from hpccomm import handles

        self.wait_all()
        live = handles.live()
        return {"calls": calls, "seconds": time.perf_counter() - t0,
                "rss_mib": rss_bytes() / 2 ** 20,
                **{f"{k}s": v for k, v in live.items()},
                "keys": sum(len(e["reducer"].keys()) for e in self.reducers),
                "state_mib": sum(e["reducer"].state_nbytes() for e in self.reducers) / 2 ** 20,
                "fds": open_fds(), "threads": threading.active_count()}


COLUMNS = ("calls", "seconds", "rss_mib", "comms", "datatypes", "ops", "requests", "keys",
           "state_mib", "fds", "threads")


def verdict(samples: List[Dict[str, float]]) -> Dict[str, object]:
    """Growth after warm-up: of resident memory, from the sample at 10 % of
    the run (the first at or past it) to the last, as a fraction; of the
    rest, the most in the last half of the run less the most from 10 % to
    50 % (keys come and go, so their state's bytes go up and down: only a
    higher peak is growth)."""
    total = samples[-1]["calls"]
    start = next(s for s in samples if s["calls"] >= 0.1 * total)
    early = [s for s in samples if 0.1 * total <= s["calls"] <= 0.5 * total]
    late = [s for s in samples if s["calls"] > 0.5 * total] or samples[-1:]
    out = {"from_calls": start["calls"], "to_calls": total,
           "rss_growth": samples[-1]["rss_mib"] / start["rss_mib"] - 1}
    for name in COLUMNS[3:]:
        out[f"{name}_growth"] = max(s[name] for s in late) - max(s[name] for s in early)
    return out


def main(argv=None) -> int:
    from mpi4py import MPI

    args = build_parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    soak = Soak(comm, args)
    samples = []
    t0 = time.perf_counter()
    if rank == 0:
        print(f"soak: {args.calls} calls on {comm.Get_size()} ranks, {len(MIX)} reducers "
              f"({', '.join(n for n, _ in MIX)}), keys "
              f"{'unbounded' if args.unbounded else 'bounded (max_keys) or reset'}; "
              f"maximum over ranks every {args.sample} calls", flush=True)
        print("  ".join(f"{c:>9}" for c in COLUMNS), flush=True)
    for i in range(1, args.calls + 1):
        soak.call()
        if i % args.state_every == 0:
            soak.wait_all()
            soak.state_dicts()
        if i % args.sample == 0 or i == args.calls:
            s = soak.sample(i, t0)
            samples.append(s)
            worst = {c: max(v) for c, v in
                     zip(COLUMNS, zip(*comm.allgather([s[c] for c in COLUMNS])))}
            if rank == 0:
                print("  ".join(f"{worst[c]:>9.1f}" if isinstance(worst[c], float)
                                else f"{worst[c]:>9}" for c in COLUMNS), flush=True)
    mine = verdict(samples)
    verdicts = comm.allgather(mine)
    every = comm.gather(samples, root=0)
    if rank == 0:
        rss = max(v["rss_growth"] for v in verdicts)
        others = {k: max(v[k] for v in verdicts) for k in mine
                  if k.endswith("_growth") and k != "rss_growth"}
        flat = rss < RSS_GROWTH and all(v <= 1e-9 for v in others.values())
        print(f"resident memory over calls {mine['from_calls']}..{mine['to_calls']}: "
              f"{rss * 100:+.2f} % on the worst rank (target < {RSS_GROWTH * 100:.0f} %)")
        print("the rest, peak of the last half less peak of 10-50 % (worst rank): " +
              ", ".join(f"{k[:-7]} {v:+.3g}" for k, v in others.items()))
        print(f"soak: {'FLAT' if flat else 'GROWS'}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "ranks": comm.Get_size(), "mix": MIX,
                           "samples": every, "verdicts": verdicts, "flat": flat}, f, indent=1)
    return 0
