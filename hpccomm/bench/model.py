"""``python -m hpccomm.bench model``: predicted training-step time and throughput
of real networks for P = 2 ... 512 ranks, per codec, from the cost model.

    python -m hpccomm.bench model [--profile FILE] [--networks resnet50,gpt2]
        [--ranks 2,8,32,128,512] [--rates 1,10,25,100] [--latency-us 5]
        [--codecs onebit,terngrad,qsgd,topk,dgc,bf16] [--compute-ms 2]
        [--batch 32] [--plot DIR] [-J FILE]

The network's gradient tensors (:mod:`hpccomm.bench.networks`) are fused into
25 MiB buckets in backward order (PyTorch DDP's default).  Each bucket's
reduction is predicted per algorithm and the cheapest taken (``auto``'s rule,
with its margin):

* dense, ring ``MPI_Allreduce``: ``2 (P-1) (alpha + b / (P R))`` for ``b`` bytes;
* ``twoshot``: the kernels (the profile's, per rank: ``P`` chunk encodes, the
  owner step, ``P - 2`` more decode-adds, ``P - 1`` decodes) and an all-to-all
  and a ring allgather of ``P - 1`` chunk packets each, ``(P-1) (alpha + C / R)``;
  pipelined in segments as ``twoshot`` does across nodes;
* ``allgather``: the encode, ``(P-1) (alpha + C(n) / R)``, ``P`` decodes.

Link: ``R`` per host in each direction (``--rates`` in Gbit/s), ``alpha``
(``--latency-us``).  Backward compute: ``--compute-ms`` per million parameters,
spread over the tensors by size; forward takes half of backward.  Without
overlap a step is forward + backward + every bucket's reduction; with overlap a
bucket starts when backward has produced it and the previous one is done.
Throughput: ``P * batch / step``.  Kernel costs come from ``--profile`` (a
``calibrate`` profile) or the built-in single-core defaults: on one core per
rank, as measured here; faster kernels (more cores, a GPU) favour compression.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Tuple

from .networks import NETWORKS

BUCKET_BYTES = 25 << 20
SEGMENT_ELEMENTS = 1 << 21


def buckets(layers: List[int]) -> List[Tuple[int, int]]:
    """``(elements, parameters produced before it is ready)`` per bucket, in
    backward order (the last layer's gradient first)."""
    out, cur, produced = [], 0, 0
    for n in reversed(layers):
        cur += n
        produced += n
        if 4 * cur >= BUCKET_BYTES:
            out.append((cur, produced))
            cur = 0
    if cur:
        out.append((cur, produced))
    return out


class NetworkModel:
    """Reduction time of one bucket for P ranks on a link of ``rate`` bytes/s."""

    def __init__(self, costs, P: int, rate: float, alpha: float):
        self.costs, self.P, self.rate, self.alpha = costs, P, rate, alpha

    def dense(self, n: int) -> float:
        P = self.P
        return 2 * (P - 1) * (self.alpha + 4 * n / (P * self.rate)) + self.costs.overhead["dense"]

    def compressed(self, codec, n: int) -> Dict[str, float]:
        from hpccomm import cost_model

        P, c, name = self.P, self.costs, codec.name
        m = -(-n // P)
        chunk = cost_model.wire_bytes(codec, m, (m,))
        ts = c.twoshot_terms(name, n, P, chunk)        # the profile's kernels, per rank
        kernels = ts["kernels"]
        wire = 2 * (P - 1) * (self.alpha + chunk / self.rate)
        S = min(16, max(1, n // SEGMENT_ELEMENTS)) if codec.segment_unit((n,)) else 1
        twoshot = (max(kernels, wire) + min(kernels, wire) / S if S > 1 else kernels + wire)
        whole = cost_model.wire_bytes(codec, n, (n,))
        ag = c.allgather_terms(name, n, P, whole)
        allgather = ag["kernels"] + (P - 1) * (self.alpha + whole / self.rate)
        return {"twoshot": twoshot + ts["overhead"], "allgather": allgather + ag["overhead"]}

    def bucket(self, codec, n: int) -> Tuple[float, str]:
        """The fastest way to reduce a bucket of ``n`` (auto's rule)."""
        from hpccomm.collectives.auto import MARGIN

        best, how = self.dense(n), "dense"
        if codec is not None:
            for name, t in self.compressed(codec, n).items():
                if t < best * (1 - MARGIN):
                    best, how = t, name
        return best, how


def step_time(model: NetworkModel, codec, layers: List[int], compute_per_param: float,
              overlap: bool) -> Tuple[float, int]:
    """Seconds of one training step and how many buckets went compressed."""
    backward = compute_per_param * sum(layers)
    forward = backward / 2
    done, compressed = 0.0, 0
    comm_total = 0.0
    for n, produced in buckets(layers):
        t, how = model.bucket(codec, n)
        compressed += how != "dense"
        comm_total += t
        ready = compute_per_param * produced
        done = max(done, ready) + t
    if overlap:
        return forward + max(backward, done), compressed
    return forward + backward + comm_total, compressed


def run(args) -> List[dict]:
    import hpccomm
    from hpccomm import cost_model

    profile, source = cost_model.load(args.profile)
    costs = cost_model.CostModel(profile)
    rows = []
    for net in args.networks:
        layers = NETWORKS[net]()
        for gbit in args.rates:
            for P in args.ranks:
                model = NetworkModel(costs, P, gbit * 1e9 / 8, args.latency_us * 1e-6)
                for name in ["dense"] + args.codecs:
                    codec = None if name == "dense" else hpccomm.get_codec(name)
                    for overlap in (False, True):
                        t, nc = step_time(model, codec, layers, args.compute_ms * 1e-9, overlap)
                        rows.append({"network": net, "gbit": gbit, "ranks": P, "codec": name,
                                     "overlap": overlap, "step_s": t, "compressed_buckets": nc,
                                     "buckets": len(buckets(layers)),
                                     "throughput": P * args.batch / t, "profile": source})
    return rows


def tables(rows: List[dict]) -> str:
    """Speedup over dense per (network, rate, P), with overlap; then the cases
    in which compression does not help (< 5 % faster than dense)."""
    out = ["| network | Gbit/s | P | dense step | " + " | ".join(
        sorted({r["codec"] for r in rows} - {"dense"})) + " |"]
    codecs = sorted({r["codec"] for r in rows} - {"dense"})
    out.append("|" + "---|" * (4 + len(codecs)))
    key = lambda r: (r["network"], r["gbit"], r["ranks"])  # noqa: E731
    dense = {key(r): r for r in rows if r["codec"] == "dense" and r["overlap"]}
    by = {(key(r), r["codec"]): r for r in rows if r["overlap"]}
    no_help = []
    for k, d in sorted(dense.items()):
        cells = []
        for c in codecs:
            s = d["step_s"] / by[(k, c)]["step_s"]
            cells.append(f"{s:.2f}×")
            if s < 1.05:
                no_help.append(f"{k[0]} at {k[1]} Gbit/s, P = {k[2]}: {c} ({s:.2f}×)")
        out.append(f"| {k[0]} | {k[1]:g} | {k[2]} | {d['step_s'] * 1e3:.1f} ms | "
                   + " | ".join(cells) + " |")
    out.append("")
    out.append(f"Compression does not help (< 1.05× with overlap) in {len(no_help)} of "
               f"{len(dense) * len(codecs)} cases:")
    out += [f"- {line}" for line in no_help]
    return "\n".join(out)


def plot(rows: List[dict], outdir: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    paths = []
    for net in sorted({r["network"] for r in rows}):
        for gbit in sorted({r["gbit"] for r in rows}):
            fig, ax = plt.subplots(figsize=(6, 4))
            for codec in sorted({r["codec"] for r in rows}, key=lambda c: (c != "dense", c)):
                pts = sorted((r["ranks"], r["throughput"]) for r in rows if r["network"] == net
                             and r["gbit"] == gbit and r["codec"] == codec and r["overlap"])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=codec,
                        color="black" if codec == "dense" else None,
                        linewidth=2.5 if codec == "dense" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks")
            ax.set_ylabel("samples / s (predicted)")
            ax.set_title(f"{net}, {gbit:g} Gbit/s, overlap")
            ax.legend(fontsize=7)
            path = os.path.join(outdir, f"model-{net}-{gbit:g}gbit.png")
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hpccomm.bench model",
                                description="Predicted step time and throughput of real "
                                            "networks for 2-512 ranks, per codec.")
    csv = lambda f: lambda s: [f(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--profile", default=None, help="calibration profile (default: built-in)")
    p.add_argument("--networks", type=csv(str), default=list(NETWORKS))
    p.add_argument("--ranks", type=csv(int), default=[2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--rates", type=csv(float), default=[1, 10, 25, 100], help="Gbit/s per host")
    p.add_argument("--latency-us", type=float, default=5.0)
    p.add_argument("--codecs", type=csv(str), default=["onebit", "terngrad", "qsgd", "topk",
                                                        "dgc", "bf16"])
    p.add_argument("--compute-ms", type=float, default=2.0,
                   help="backward compute per million parameters (ms)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--plot", default=None, metavar="DIR", help="PNGs of throughput vs ranks")
    p.add_argument("-J", "--json", default=None, metavar="FILE")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    unknown = set(args.networks) - set(NETWORKS)
    if unknown:
        raise SystemExit(f"unknown networks {sorted(unknown)}; known: {', '.join(NETWORKS)}")
    rows = run(args)
    print(tables(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if args.plot:
        for path in plot(rows, args.plot):
            print(f"# wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
