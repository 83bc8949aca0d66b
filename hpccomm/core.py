"""The public entry points: :class:`Allreducer` and :func:`allreduce`."""
from __future__ import annotations

import functools
import time
from collections import OrderedDict
from typing import Any, Dict, Optional

import numpy as np
from mpi4py import MPI

from .buffers import (Buffer, HostStaging, as_buffer, bf16_bits_to_f32, f32_to_bf16_bits,
                      placement_of, resolve_gpu_aware)
from .codecs import Codec, default_algorithm, get_codec
from .collectives.base import Algorithm, ReduceContext, get_algorithm_class
from .collectives.mpi import device_allreduce
from .collectives.on_device import DEVICE_ALGORITHMS, DevicePath, why_not_on_device
from .collectives.transport import INT_MAX, Transport, allreduce_bytes, allreduce_sum
from .communicators import private_comm, ranks_on_node
from .errors import ConsistencyError, nonfinite_input
from .failstop import check_on_error, stranded
from .kernels import threads
from .layout import check_layout
from .kernels.nonfinite import count_nonfinite
from .memory import Memory, get_memory
from . import requests
from .options import resolve_options
from .requests import Request
from .state import KeyState
from .stats import CallStats, Stats
from .validation import agree, check_local

_now = time.perf_counter

OPS = ("sum", "mean")
CHECKS = ("always", "first", "never")

class Allreducer:
    """A configured compressed allreduce that keeps state per tensor key.

    Parameters
    ----------
    comm:
        The communicator (default ``MPI.COMM_WORLD``).  hpccomm works on a
        private duplicate of it.
    codec, algorithm:
        Names from :func:`available_codecs` / :func:`available_algorithms`, or
        a :class:`~hpccomm.codecs.Codec` instance.  Without an algorithm:
        ``"twoshot"`` for a codec that sends packets (every quantizer and
        sparsifier), the codec's own for ``powersgd``, and ``"mpi"``
        (``MPI_Allreduce``) for ``codec="none"``.  ``algorithm="auto"``
        chooses per call from a calibrated cost model.
    op:
        ``"sum"`` or ``"mean"`` (the mean divides the sum by the number of
        ranks once, at the end, with IEEE division).
    error_feedback:
        The worker's memory (:mod:`hpccomm.memory`): ``True`` / ``"residual"``
        (``v = g + e``, ``e = v - decoded``), ``False`` / ``"none"``,
        ``"dgc"`` or a :class:`~hpccomm.memory.DGCMemory` (DGC's momentum
        correction and masking), or ``None`` for the codec's default (a
        residual for biased codecs such as onebit, topk, threshold).  Memory is
        kept per ``key``; calls without a key keep no state.  Unbiased codecs
        (qsgd, terngrad, randk) under a memory send their contractive form
        ``C / (1 + omega)`` (see each codec's docstring).
    check:
        ``"always"`` (default): every call first agrees across ranks on the
        length, dtype, codec, algorithm, op and key, and on whether any rank
        hit a local error, with one 32-byte ``MPI_Allreduce``; any problem is
        raised on every rank.  ``"first"``: only on the first call of each key
        (later local errors are raised on that rank only -- run under
        ``python -m mpi4py`` so that aborts all ranks).  ``"never"``.
    on_error:
        What an exception raised on some ranks *inside* a call (after its
        agreement: a corrupted packet, a codec or kernel that raises on one
        rank) does, where the other ranks would wait forever:
        ``"abort"`` (default) prints it with the rank and calls
        ``MPI_Abort``, ending the job; ``"raise"`` raises it on that rank
        only (see :mod:`hpccomm.failstop`).
    max_keys:
        Keep the state (residuals, step count, caches) of at most this many
        keys: the first call of a new key beyond it forgets the key called
        least recently -- the same key on every rank, since every rank makes
        the same calls in the same order.  A forgotten key that comes back
        starts afresh, as after :meth:`reset`.  ``None`` (default): keep
        every key until ``reset(key)``; a code whose keys come and go
        (dynamic shapes, a growing model) sets a bound or resets the keys it
        retires.
    gpu_aware:
        ``"auto"`` (ask the MPI library), ``"on"``, ``"off"``: whether device
        pointers may be passed to MPI; otherwise device data is staged through
        reused host buffers.
    seed:
        Seed of the counter-based random numbers of stochastic codecs.
    fused:
        Let a codec with a fused kernel do error feedback and its encode in
        one pass (default).  ``False`` runs the three-step reference
        (compensate, encode, decode and subtract): the same bits, slower.
    **options:
        Codec or algorithm parameters, routed by name (e.g. ``ratio=0.01``
        for ``topk``).
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, *, codec: Any = "none",
                 algorithm: Optional[str] = None, op: str = "sum", error_feedback: Any = None,
                 check: str = "always", on_error: str = "abort",
                 max_keys: Optional[int] = None, gpu_aware: Any = "auto",
                 seed: int = 0, fused: bool = True,
                 codec_options: Optional[dict] = None, algorithm_options: Optional[dict] = None,
                 **options):
        self.parent = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(self.parent, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py Intracomm, not {type(comm).__name__}")
        self.rank = self.parent.Get_rank()
        self.size = self.parent.Get_size()
        self.stats = Stats()
        #: per key, its state, the key called least recently first
        self._states: "OrderedDict[str, KeyState]" = OrderedDict()
        self.max_keys = max_keys
        #: per key, the last call's signature when that call was one plain
        #: MPI_Allreduce of a host array (see :meth:`_lean_call`)
        self._lean: Dict[str, _Lean] = {}
        self._staging = HostStaging()
        #: the device pipelines, by GPU ordinal (made on the first device call
        #: on that GPU that can use one)
        self._device: Dict[int, DevicePath] = {}
        self._comm: Optional[MPI.Comm] = None
        self.codec: Optional[Codec] = None
        self.algorithm: Optional[Algorithm] = None
        self.op, self.check, self.seed = op, check, int(seed)
        self.on_error = on_error
        self.fused = bool(fused)
        self._description: Optional[str] = None
        #: the error a bad configuration raises, or None.  Construction errors
        #: are not raised here: the first call (which is collective) raises
        #: them on every rank alike.
        _, self.config_error = check_local(self._configure, codec, algorithm, op, error_feedback,
                                          check, on_error, max_keys, gpu_aware, codec_options,
                                          algorithm_options, options)

    # ------------------------------------------------------------------ setup
    def _configure(self, codec, algorithm, op, error_feedback, check, on_error, max_keys,
                   gpu_aware, codec_options, algorithm_options, options):
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, not {op!r}")
        if check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS}, not {check!r}")
        check_on_error(on_error)
        if max_keys is not None and (isinstance(max_keys, bool) or not isinstance(max_keys, int)
                                     or max_keys < 1):
            raise ValueError(f"max_keys must be a positive int or None, not {max_keys!r}")
        if algorithm is None:
            algorithm = default_algorithm(codec)
        alg_cls = get_algorithm_class(algorithm)
        codec_opts, alg_opts = resolve_options(codec, algorithm, options)
        codec_opts.update(codec_options or {})
        alg_opts.update(algorithm_options or {})
        self.codec = get_codec(codec, **codec_opts)
        self.algorithm = alg_cls(self.parent, self.codec, **alg_opts)
        self.memory: Memory = get_memory(error_feedback, biased=self.codec.biased)
        self.algorithm.check_memory(self.memory)
        self.gpu_aware = resolve_gpu_aware(gpu_aware)

    def describe(self) -> str:
        if self.codec is None:
            return "<invalid configuration>"
        if self._description is None:  # the configuration is fixed once built
            self._description = (f"codec={self.codec.describe()} "
                                 f"algorithm={self.algorithm.describe()} op={self.op} "
                                 f"ef={self.memory.describe()} seed={self.seed}")
        return self._description

    def __repr__(self) -> str:
        return f"Allreducer({self.describe()}, ranks={self.size})"

    @property
    def comm(self) -> MPI.Comm:
        return self._comm if self._comm is not None else self.parent

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's state: per key, the step count and the residuals (as
        host arrays; residuals kept on a GPU are copied once its pipeline's
        last call is done).

        Residuals differ between ranks: every rank saves and loads its own."""
        requests.drain()
        keys = {}
        for key, state in self._states.items():
            gpu = state.cache.get("device")
            keys[key] = state.state_dict(None if gpu is None else self._device[gpu].to_host)
        return {"format": 1, "config": self.describe(), "rank": self.rank, "size": self.size,
                "keys": keys}

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` saved on this rank, with this reducer's
        configuration and number of ranks.  Collective: a refused state on
        any rank is raised on every rank."""
        requests.drain()
        states, err = check_local(self._loaded_states, state)
        agree(self.comm, "load_state_dict", err)
        self._states = OrderedDict(states)
        self._lean.clear()

    def _loaded_states(self, state: dict) -> Dict[str, KeyState]:
        if not isinstance(state, dict) or state.get("format") != 1:
            raise ValueError("unknown state_dict format")
        if state.get("config") != self.describe():
            raise ValueError(f"state_dict was saved by {state.get('config')!r}, this reducer is "
                             f"{self.describe()!r}")
        if (state.get("rank"), state.get("size")) != (self.rank, self.size):
            raise ValueError(f"state_dict was saved by rank {state.get('rank')} of "
                             f"{state.get('size')}, this is rank {self.rank} of {self.size} "
                             f"(residuals belong to one rank at one size: every rank loads "
                             f"its own)")
        return {k: KeyState.from_state_dict(v) for k, v in state["keys"].items()}

    def reset(self, key: Optional[str] = None) -> None:
        """Forget residuals and step counts (of one key, or of all)."""
        requests.drain()
        self._lean.clear()
        if key is None:
            self._states.clear()
        else:
            self._states.pop(key, None)

    def close(self) -> None:
        """Release buffers and state.  The private communicator is shared
        by everything built on the user's communicator and freed with it."""
        requests.drain()
        self._states.clear()
        self._lean.clear()
        self._staging = HostStaging()
        self._device = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ call
    def _prepare(self, x, out, key, layout=None, where=None):
        buf = as_buffer(x, where)
        if buf.dtype not in self.codec.input_dtypes:
            raise TypeError(f"codec {self.codec.name!r} does not take {buf.dtype} input "
                            f"(takes {', '.join(self.codec.input_dtypes)})")
        if buf.dtype == "float64" and "float64" not in self.algorithm.dtypes:
            raise TypeError(f"float64 is reduced only by algorithms {('mpi',)}; "
                            f"algorithm {self.algorithm.name!r} works in float32")
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key must be a string, not {type(key).__name__}")
        known = self._states.get(key) if key is not None else None
        if known is not None and known.n is not None and known.n != buf.size:
            raise ValueError(f"key {key!r} names a tensor of {known.n} elements, this call has "
                             f"{buf.size} (its residuals and step count belong to the first): "
                             f"use another key, or reset({key!r}) first")
        if (buf.on_device and known is not None
                and known.cache.get("device", buf.where.device) != buf.where.device):
            raise ValueError(f"key {key!r} keeps its residuals on GPU {known.cache['device']}, "
                             f"this call's input is on GPU {buf.where.device}: use another key "
                             f"per GPU, or reset({key!r}) first")
        obuf = None
        if out is not None:
            obuf = as_buffer(out, buf.where)
            if obuf.size != buf.size or obuf.dtype != buf.dtype or obuf.on_device != buf.on_device:
                raise ValueError(f"out has {obuf.size} {obuf.dtype} elements "
                                 f"({'device' if obuf.on_device else 'host'}), input has "
                                 f"{buf.size} {buf.dtype} ({'device' if buf.on_device else 'host'})")
            gpu = obuf.backend.placement(obuf.device).device if obuf.on_device else None
            if gpu is not None and gpu != buf.where.device:
                raise ValueError(f"out is on GPU {gpu}, the input on GPU {buf.where.device}")
            if not obuf.on_device and not obuf.host.flags.writeable:
                raise ValueError("out is read-only")
        if layout is not None:
            layout = check_layout(layout, buf.size)
        defer = self._defers_check(buf)
        if self._scans_input(buf, defer) and buf.size:
            if buf.on_device:      # ordered on the input's stream; the count comes back
                bad = buf.backend.count_nonfinite(buf.device, buf.size, buf.dtype, buf.where)
            else:
                bad = count_nonfinite(np.ascontiguousarray(buf.host),
                                      bfloat16=buf.dtype == "bfloat16")
            if bad:
                raise nonfinite_input(bad, self.codec.name)
        check = getattr(self.codec, "check_values", None)
        if check is not None and not defer and buf.size:
            # a codec with a limited range (ebq): raised here, on every rank,
            # rather than by one rank's encode after the agreement (device
            # input: through a host copy; no such codec has a device twin)
            check(self._host_copy(buf) if buf.on_device else buf.host,
                  terms=self.size if self.algorithm.encodes_sums else 1,
                  feedback=self.memory.enabled)
        return buf, obuf, defer, layout

    @staticmethod
    def _host_copy(buf: Buffer) -> np.ndarray:
        """A host copy of device input ``buf``, widened to float32."""
        if buf.dtype == "bfloat16":
            bits = np.empty(buf.size, np.uint16)
            buf.backend.to_host(buf.device, bits, buf.where)
            return bf16_bits_to_f32(bits)
        host = np.empty(buf.size, np.dtype(buf.dtype))
        buf.backend.to_host(buf.device, host, buf.where)
        return host

    def _scans_input(self, buf: Buffer, deferred: bool) -> bool:
        """Whether this call scans ``buf`` for NaN/Inf before the collective
        agreement (so the error is raised on every rank; the codecs then skip
        their own scan of the same data) -- unless the check is deferred to
        the encode, which counts them in its one pass (:meth:`_defers_check`)."""
        return self.codec.nonfinite == "raise" and self.check == "always" and not deferred

    def _defers_check(self, buf: Buffer) -> bool:
        """Whether the cross-rank check of this call runs after the local
        encode instead of before it: when the encode is a fused kernel that
        counts NaN/Inf on its pass (error feedback with a fusable memory, a
        codec with ``encode_with_feedback``, an algorithm that encodes through
        :class:`~hpccomm.collectives.base.Contribution`), so the input is not
        read once more just to look for them.  Nothing is sent before the
        check, so a bad value is still raised on every rank.  Not on the
        first call (the private communicator is made then)."""
        return (self._comm is not None and self.check == "always" and self.fused
                and self.codec.nonfinite == "raise" and not buf.on_device
                and buf.dtype == "float32" and self.memory.fusable
                and self.algorithm.checks_after_encode(buf.size, buf.shape)
                and getattr(self.codec, "encode_with_feedback", None) is not None)

    def __call__(self, x: Any, key: Optional[str] = None, *, out: Any = None,
                 layout: Any = None) -> Any:
        """Reduce ``x`` over all ranks; return the result as the same kind of
        object and shape (written into ``out`` when given; ``out`` may be
        ``x`` itself).  ``layout``: the shapes of the tensors fused into
        ``x``, in order (a fusion bucket's; their sizes add up to ``x``'s),
        for algorithms that work per tensor (``powersgd``); the same on
        every rank."""
        # behind the started calls, in order.  Draining them first (rather than
        # queueing this call when some are pending) keeps every rank on the
        # same path whatever its own thread has finished: a rank with nothing
        # pending and one still waiting must make the same MPI calls on the
        # same communicators.
        requests.drain()
        return self._call(x, key, out, layout)

    def _call(self, x: Any, key: Optional[str], out: Any, layout: Any = None,
              where: Any = None) -> Any:
        if type(key) is str and type(x) is np.ndarray and layout is None:
            lean = self._lean.get(key)
            if lean is not None and x.shape == lean.shape and x.dtype is lean.dtype:
                result = (self._lean_call(lean, x, out) if lean.plan is None
                          else self._planned_call(lean, x, out))
                if result is not None:
                    return result
        t0 = time.perf_counter()
        err = self.config_error
        prepared = None
        if err is None:
            prepared, err = check_local(self._prepare, x, out, key, layout, where)
        first = key is None or not isinstance(key, str) or key not in self._states
        deferred = None
        if self.check == "always" or first or self._comm is None:
            if err is None:
                buf = prepared[0]
                desc = f"n={buf.size} dtype={buf.dtype} key={key!r} {self.describe()}"
                if prepared[3] is not None:
                    desc += f" layout={prepared[3]}"
                if prepared[2]:
                    deferred = functools.partial(agree, self.comm, desc)
            else:
                desc = "<error>"
            if deferred is None:
                agree(self.comm, desc, err)
        elif err is not None:
            raise err
        if self._comm is None:
            self._comm = private_comm(self.parent)
            threads.fit_to_node(ranks_on_node(self._comm))
        buf, obuf, defers, layout = prepared
        state = self._states.get(key) if key is not None else None
        if state is None:
            state = KeyState(n=buf.size)
            if key is not None:
                self._keep(key, state)
        elif state.n is None:        # loaded from a state_dict that did not record it
            state.n = buf.size
        call = CallStats(key=key or "", n=buf.size)
        ctx = ReduceContext(net=Transport(self._comm, call), memory=self.memory,
                            seed=self.seed, step=state.step, shape=buf.shape, layout=layout,
                            key=key,
                            fused=self.fused, finite=self._scans_input(buf, defers), agree=deferred,
                            where=buf.where)
        try:
            if buf.on_device:
                result = self._reduce_device(buf, obuf, state, ctx)
            else:
                result = self._reduce_host(buf, obuf, buf.host, state, ctx)
                result = buf.wrap(result) if obuf is None else obuf.obj
        except Exception as exc:
            stranded(exc, self._comm, self.on_error,
                     lambda: self._call_text(buf.size, key, state.step))
            raise
        state.step += 1
        call.t_total = time.perf_counter() - t0
        self.stats.record(call)
        if key is not None:
            self._states.move_to_end(key)
            if type(x) is np.ndarray:
                self._remember_lean(key, x, buf, state, call,
                                    desc if self.check == "always" else None, layout)
        return result

    def _keep(self, key: str, state: KeyState) -> None:
        """Add ``key``'s state, forgetting the key called least recently
        when ``max_keys`` are kept already."""
        if self.max_keys is not None:
            while len(self._states) >= self.max_keys:
                old, _ = self._states.popitem(last=False)
                self._lean.pop(old, None)
        self._states[key] = state

    def repeat_path(self, key: str) -> Optional[str]:
        """How ``key``'s next call of the same shape and dtype will run:
        ``"dense"`` (one plain ``MPI_Allreduce``, :meth:`_lean_call`),
        ``"plan"`` (the algorithm's plan for the key, :meth:`_planned_call`),
        ``"kernels"`` (a plan that runs the codec's kernels alone, on packets
        laid out once: :class:`~hpccomm.collectives.twoshot.TwoShotPlan`),
        or None (the general path) -- for profiling and tests."""
        lean = self._lean.get(key)
        return None if lean is None else "dense" if lean.plan is None else lean.plan.kind

    def keys(self) -> list:
        """The keys whose state this reducer keeps, the least recently called first."""
        return list(self._states)

    def state_nbytes(self) -> int:
        """Bytes of the residuals and spare buffers kept for all keys (host
        and device memory alike): what the keys' state holds between calls."""
        return sum(getattr(a, "nbytes", 0) for state in self._states.values()
                   for a in (*state.residuals.values(), *state.spares.values()))

    # ------------------------------------------------------------------ non-blocking
    def start(self, x: Any, key: Optional[str] = None, *, out: Any = None,
              layout: Any = None) -> Request:
        """Start reducing ``x``; return a :class:`~hpccomm.requests.Request`
        whose ``wait()`` gives what ``self(x, key, out=out)`` gives, bit for
        bit (see :mod:`hpccomm.requests`).  ``x`` (and ``out``) must not be
        touched until then.  Every rank starts the same keys in the same order.

        Device input is reduced on the stream that is current for it here, on
        the caller's thread (the progress thread has streams of its own)."""
        request = Request(key)
        where = placement_of(x)
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:   # no thread may call MPI: run it now
            try:
                request._finish(self._call_checked(x, key, out, layout, where), None)
            except Exception as exc:  # noqa: BLE001 -- raised by wait(), as the thread would
                request._finish(None, exc)
            return request
        if self._comm is None and self.config_error is None:
            # collective, on the caller's thread, with no started call in flight: MPICH
            # crashed making a communicator while another thread was in a collective
            requests.drain()
            self._comm = private_comm(self.parent)
            threads.fit_to_node(ranks_on_node(self._comm))
        requests.progress_thread().submit(
            request, functools.partial(self._call_checked, x, key, out, layout, where))
        return request

    def _call_checked(self, x: Any, key: Optional[str], out: Any, layout: Any = None,
                      where: Any = None) -> Any:
        """A started call: the start order agreed first (unless the call's own
        agreement covers it, or ``check="never"``), then the blocking call."""
        if self.check == "first" and self.config_error is None:
            agree(self.comm, f"start key={key!r} n={_length(x)}")
        return self._call(x, key, out, layout, where)

    # ------------------------------------------------------------------ lean path
    def _remember_lean(self, key, x, buf, state, call, desc, layout) -> None:
        """Remember how ``key``'s next calls may run: as one plain
        MPI_Allreduce (:meth:`_lean_call`) when this call was one, of a
        contiguous host array in a dtype MPI sums natively; or through the
        algorithm's plan for the key (:meth:`_planned_call`), where it has one
        for this call -- host float32 in fused kernels, no codec range check
        and no layout."""
        self._lean.pop(key, None)
        if not (self.size > 1 and 0 < x.size <= INT_MAX and x.flags.c_contiguous):
            return
        if buf.dtype in self.algorithm.dtypes and self.algorithm.sends_dense(buf.size, buf.shape,
                                                                            key):
            moved = allreduce_bytes(x.nbytes, self.size)
            template = CallStats(key=key, n=x.size, nbytes=x.nbytes, bytes_sent=moved,
                                 bytes_recv=moved, modelled=True, extra=dict(call.extra))
            self._lean[key] = _Lean(key, x.shape, x.dtype, desc, self._scans_input(buf, False),
                                    state, template.extra, template=template)
            return
        if (buf.dtype == "float32" and layout is None and self.fused
                and getattr(self.codec, "check_values", None) is None):
            defers = self._defers_check(buf)
            plan = self.algorithm.repeat_plan(self._comm, buf.size, buf.shape, state,
                                              self.memory, defers)
            if plan is not None:
                self._lean[key] = _Lean(key, x.shape, x.dtype, desc,
                                        self._scans_input(buf, defers), state, dict(call.extra),
                                        plan, defers)

    def _planned_call(self, lean: "_Lean", x: np.ndarray, out: Any) -> Optional[np.ndarray]:
        """The repeated call of a key through the algorithm's plan
        (:meth:`~hpccomm.collectives.base.Algorithm.repeat_plan`): the same
        deferred cross-rank check, collectives, bits, state and statistics as
        the general path, without rebuilding per call what does not change.
        Returns None (nothing done) when this call does not fit (another
        ``out``, a strided input): the general path then runs it,
        collectively compatible with the ranks that took this one."""
        t0 = time.perf_counter()
        if not x.flags.c_contiguous:
            return None
        if out is None:
            res = np.empty_like(x)
        elif (type(out) is np.ndarray and out.shape == x.shape and out.dtype == x.dtype
              and out.flags.c_contiguous and out.flags.writeable
              and not np.may_share_memory(out, x)):
            res = out
        else:
            return None
        state = lean.state
        call = CallStats(key=lean.key, n=x.size, nbytes=x.nbytes, extra=dict(lean.extra))
        flat = x.reshape(-1)
        check = None
        if lean.desc is not None:       # check="always": as the general path checks
            if lean.defers:             # after the local encode
                check = functools.partial(agree, self.comm, lean.desc)
            else:                       # before it, with the input's NaN/Inf scan
                bad = count_nonfinite(flat) if lean.scan else 0
                agree(self.comm, lean.desc, nonfinite_input(bad, self.codec.name) if bad else None)
        try:
            lean.plan.reduce(flat, res.reshape(-1), state, call, self.seed, x.shape,
                             self.memory, lean.scan, check)
        except Exception as exc:
            stranded(exc, self._comm, self.on_error,
                     lambda: self._call_text(x.size, lean.key, state.step))
            raise
        self._finish_mean(res)
        state.step += 1
        self._states.move_to_end(lean.key)
        call.t_total = time.perf_counter() - t0
        self.stats.record(call)
        return res

    def _lean_call(self, lean: "_Lean", x: np.ndarray, out: Any) -> Optional[np.ndarray]:
        """The repeated dense call of a key, without the algorithm: the same
        checks (the cross-rank agreement under ``check="always"``, with the
        same description, and the NaN/Inf scan where the full path makes
        it), the same ``MPI_Allreduce`` on the private communicator, the same
        statistics (recorded from the key's ``lean.template``).
        Returns None (nothing done) when this call does not fit (another
        ``out``, a strided input, a NaN to report): the full path then
        handles it, collectively compatible with ranks that took this one
        (both agree on the same description, then reduce the same way)."""
        t0 = _now()
        if not x.flags.c_contiguous:
            return None
        if out is None:
            res, send = np.empty(lean.shape, lean.dtype), x
        elif out is x:
            res, send = x, MPI.IN_PLACE
        elif type(out) is np.ndarray and out.shape == lean.shape and out.dtype is lean.dtype:
            flags = out.flags
            if not (flags.c_contiguous and flags.writeable) or _may_overlap(out, x):
                return None
            res, send = out, x
        else:
            return None
        if lean.scan and count_nonfinite(x.reshape(-1)):
            return None
        if lean.desc is not None:
            agree(self.comm, lean.desc)
        t1 = _now()
        try:
            allreduce_sum(self._comm, send, res)
        except Exception as exc:
            stranded(exc, self._comm, self.on_error,
                     lambda: self._call_text(x.size, lean.key, lean.state.step))
            raise
        t2 = _now()
        if self.op == "mean":
            np.divide(res, res.dtype.type(self.size), out=res)
        lean.state.step += 1
        self._states.move_to_end(lean.key)
        self.stats.record_repeat(lean.template, t2 - t1, _now() - t0)
        return res

    def _call_text(self, n: int, key: Optional[str], step: int) -> str:
        """The call an error message names."""
        return f"allreduce of {n} elements, key {key!r}, step {step}, {self.describe()}"

    def _finish_mean(self, arr: np.ndarray) -> None:
        if self.op == "mean" and self.size > 1:
            np.divide(arr, arr.dtype.type(self.size), out=arr)

    def _reduce_host(self, buf: Buffer, obuf: Optional[Buffer], src: np.ndarray, state, ctx):
        """Reduce host data ``src`` (flat, in ``buf.dtype``); return the flat
        result in ``buf.dtype`` (written into ``obuf`` when given)."""
        dest = obuf.host if obuf is not None else None
        native = buf.dtype in self.algorithm.dtypes
        if native:
            work_dtype = np.dtype(buf.dtype)
            x = src
            if dest is not None and np.shares_memory(dest, src):
                x = src.copy()
            res = dest if dest is not None else np.empty(buf.size, dtype=work_dtype)
        else:  # float16 / bfloat16 -> float32 work arrays
            x = bf16_bits_to_f32(src) if buf.dtype == "bfloat16" else src.astype(np.float32)
            res = np.empty(buf.size, dtype=np.float32)
        ctx.call.nbytes = x.nbytes
        self.algorithm.reduce(x, res, state, ctx)
        self._finish_mean(res)
        if native:
            return res
        final = dest if dest is not None else np.empty(buf.size, dtype=src.dtype)
        if buf.dtype == "bfloat16":
            f32_to_bf16_bits(res, out=final)
        else:
            final[...] = res
        return final

    def _reduce_device(self, buf: Buffer, obuf: Optional[Buffer], state, ctx):
        """Device input: the device path (:mod:`hpccomm.collectives.on_device`:
        codec kernels on the device, only packets staged) where it applies;
        else dense device memory straight to CUDA-aware MPI; else the whole
        gradient staged through host memory (``extra["staged"] =
        "gradient"``, with the reason in ``extra["device"]``)."""
        backend, call, where = buf.backend, ctx.call, buf.where
        result_dev = obuf.device if obuf is not None else backend.empty_like(buf.device, where)
        path, reason = self._device_path(buf)
        choice = path.choice(buf.size, state, ctx) if path is not None else None
        if choice in DEVICE_ALGORITHMS:
            path.reduce(buf.device, result_dev, state, ctx, choice, self.op == "mean")
            state.cache["device"] = where.device        # where the key's residuals live
        elif (self.gpu_aware and buf.dtype in self.algorithm.dtypes
              and (self.algorithm.supports_device or choice == "dense")):
            backend.synchronize(buf.device, where)      # MPI reads what the stream wrote
            call.nbytes = buf.size * np.dtype(buf.dtype).itemsize
            if self.algorithm.supports_device:
                self.algorithm.reduce_device(buf.device, result_dev, backend, state, ctx)
            else:                                   # auto chose dense
                call.extra["auto"] = "dense"
                device_allreduce(buf.device, result_dev, backend, ctx)
            if self.op == "mean" and self.size > 1:
                backend.divide(result_dev, self.size, where)
        else:
            itemsize = 2 if buf.dtype == "bfloat16" else np.dtype(buf.dtype).itemsize
            host_dtype = np.uint16 if buf.dtype == "bfloat16" else np.dtype(buf.dtype)
            host_in = self._staging.get("in", buf.size * itemsize, backend).view(host_dtype)
            with call.time("comm"):  # staging is data movement; counted as communication
                backend.to_host(buf.device, host_in, where)        # complete on return
            hbuf = Buffer(obj=None, kind="numpy", shape=buf.shape, dtype=buf.dtype, size=buf.size,
                          host=host_in)
            host_out = self._staging.get("out", buf.size * itemsize, backend).view(host_dtype)
            obuf_host = Buffer(obj=None, kind="numpy", shape=buf.shape, dtype=buf.dtype,
                               size=buf.size, host=host_out)
            self._reduce_host(hbuf, obuf_host, host_in, state, ctx)
            with call.time("comm"):
                backend.from_host(host_out, result_dev, where)     # complete on return
            call.extra.update(staged="gradient", staged_d2h=host_in.nbytes,
                              staged_h2d=host_out.nbytes,
                              device=reason or f"auto chose {choice!r}")
        if obuf is not None:
            return obuf.obj
        return buf.wrap(result_dev)

    def _device_path(self, buf: Buffer):
        """``(DevicePath, "")`` when this call may run on the device, else
        ``(None, why not)``; a path is made once per reducer and GPU."""
        if not buf.backend.device_kernels:
            return None, f"device backend {buf.backend.name!r} runs no hpccomm kernels"
        reason = why_not_on_device(self.algorithm, self.codec, self.memory, buf.dtype)
        if reason:
            return None, reason
        path = self._device.get(buf.where.device)
        if path is None:
            path = self._device[buf.where.device] = DevicePath(
                self.algorithm, self.codec, HostStaging(), self.gpu_aware, buf.backend)
        return path, ""


def allreduce(x: Any, comm: Optional[MPI.Comm] = None, *, codec: Any = "none",
              algorithm: Optional[str] = None, op: str = "sum", out: Any = None,
              **options) -> Any:
    """Reduce ``x`` over the ranks of ``comm`` and return the result as the
    same kind of object and shape as ``x``.

    Stateless: no error feedback is kept between calls (use
    :class:`Allreducer` with a ``key`` for that).  Options go to the codec or
    the algorithm by name; ``check``, ``on_error``, ``gpu_aware`` and ``seed``
    as for :class:`Allreducer`.
    """
    reducer_kw = {k: options.pop(k) for k in ("check", "on_error", "gpu_aware", "seed")
                  if k in options}
    stateful = "error_feedback" in options
    options.pop("error_feedback", None)
    reducer = Allreducer(comm, codec=codec, algorithm=algorithm, op=op, error_feedback=False,
                         **reducer_kw, **options)
    if stateful and reducer.config_error is None:   # raised on every rank by the call
        reducer.config_error = TypeError(
            "hpccomm.allreduce is stateless and takes no error_feedback: error feedback needs "
            "the residual of the previous call -- use hpccomm.Allreducer(comm, ..., "
            "error_feedback=True) and call it with a key")
    return reducer(x, out=out)


__all__ = ["Allreducer", "allreduce", "ConsistencyError"]


class _Lean:
    """What a key's repeated call needs: the dense lean path
    (:meth:`Allreducer._lean_call`, ``plan`` None; ``template`` is its
    calls' statistics but for the times) or the algorithm's plan
    (:meth:`Allreducer._planned_call`)."""

    __slots__ = ("key", "shape", "dtype", "desc", "scan", "state", "extra", "plan", "defers",
                 "template")

    def __init__(self, key, shape, dtype, desc, scan, state, extra, plan=None, defers=False,
                 template=None):
        self.key, self.shape, self.dtype, self.desc, self.scan = key, shape, dtype, desc, scan
        self.state, self.extra, self.plan, self.defers = state, extra, plan, defers
        self.template = template


def _may_overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two distinct arrays may share memory: not when both own
    their data (two allocations; ``base is None`` alone would not say so
    for an array made around foreign memory), which is cheaper to see than
    ``np.may_share_memory``."""
    return not (a.flags.owndata and b.flags.owndata) and np.may_share_memory(a, b)


def _length(x: Any) -> Any:
    """Elements of an array-like (numpy/CuPy ``size``, torch ``numel()``), or its type."""
    n = getattr(x, "size", None)
    if callable(n):
        n = x.numel() if hasattr(x, "numel") else None
    return n if isinstance(n, int) else type(x).__name__
