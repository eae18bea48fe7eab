"""Serving across ``jax.distributed`` processes: one HTTP front end (process
0, the *leader*) and followers that run the same engine in lockstep.

A model on a mesh that spans processes computes every token in every
process: each process must make the same engine calls in the same order
(the steps are SPMD programs whose collectives join the processes). The
engine's scheduler is deterministic, so it is enough that every process
sees the same arrivals, aborts and steps in the same order. The leader's
engine thread (:class:`~jaxkv.serve.http.EngineLoop`) publishes, before
each iteration, the commands it applies and whether it steps
(:meth:`Lockstep.publish`); each follower reads the records in order and
does the same (:meth:`Lockstep.follow`), checking each request id and the
digest of the leader's last step's outputs against its own. The channel is JAX's own
distributed key-value store (the coordination service every
``jax.distributed`` run has): record ``n`` under
``jaxkv/serve/op/<n>``, a pickle of the commands (our own processes of one
job; the leader already checked each request).

**Failures.** ``jax_enable_recoverability`` is turned on, so the death of
one process no longer aborts the others from inside the runtime; instead:

* the leader's watchdog (:func:`watch`) asks the coordination service
  which processes are alive every ``poll`` seconds; when one is gone, the
  server answers 503 to every request in flight and every new one, logs
  which process died, and exits (status 1) after ``grace`` seconds;
* a follower whose leader is gone (its reads fail, or the service says
  process 0 is not alive) logs it and exits (status 1).

Detection is bounded by the coordination service's heartbeat timeout
(:data:`HEARTBEAT_SECONDS`, 5 s by default; a process that exits cleanly
closes its connection and is seen sooner). A step whose collectives meet
the dead process fails at once: the leader's engine thread then waits up
to :attr:`Lockstep.verdict_seconds` for the watchdog's verdict before
treating it as an engine fault, so the requests in flight get the 503 of
a lost process, not the step's error (an engine fault that is not a lost
process costs that wait once before its requests fail with 500).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable

__all__ = ["HEARTBEAT_SECONDS", "Lockstep", "LostProcess", "alive", "initialize", "watch"]

logger = logging.getLogger("jaxkv.serve")

#: The coordination service's heartbeat timeout (``JAXKV_HEARTBEAT_SECONDS``): a process killed without
#: closing its connection is seen dead this long after (its collectives fail at once: the leader waits for
#: the verdict, :attr:`Lockstep.verdict_seconds`).
HEARTBEAT_SECONDS = int(os.environ.get("JAXKV_HEARTBEAT_SECONDS", "5"))
_WATCH_POLL = 0.5  # seconds between the watchdog's questions
_PREFIX = "jaxkv/serve/op/"
_WINDOW = 10_000  # records kept in the store: a follower never lags this far (each step is a collective)


class LostProcess(RuntimeError):
    """A process of the run died (named in the message)."""


def initialize(coordinator: str | None, num_processes: int, process_id: int) -> None:
    """Join the ``jax.distributed`` run (before anything touches a device):
    CPU collectives over gloo on a CPU backend, the coordinator at
    ``coordinator`` (``HOST:PORT``; None: the environment ``jax.distributed``
    reads), recoverability on (module docstring)."""
    import jax

    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend's collectives
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise LostProcess("jax.distributed is not initialized")
    return client


def alive(num_processes: int) -> set[int]:
    """The processes the coordination service counts as alive."""
    return set(_client().get_live_nodes(list(range(num_processes))))


class Lockstep:
    """The record stream of one serving run (module docstring)."""

    def __init__(self, num_processes: int, process_id: int):
        self.num_processes = num_processes
        self.process_id = process_id
        self._next = 0

    @property
    def verdict_seconds(self) -> float:
        """How long after a failed step the watchdog has surely named a
        dead process: twice the heartbeat timeout (the service's own
        detection is not to the second) and two of its polls."""
        return 2 * HEARTBEAT_SECONDS + 2 * _WATCH_POLL

    # ------------------------------------------------------------ leader

    def publish(self, ops: list, step: bool, *, stop: bool = False, after: str | None = None) -> None:
        """Record the next iteration: ``ops`` (``("add", prompt, kwargs,
        request id or None)``, ``("abort", request id)``) applied in order,
        then one ``engine.step()`` if ``step``; ``stop`` ends the followers.
        ``after``: the :meth:`digest` of the leader's last step's outputs
        (None before its first), which each follower checks against its own."""
        client = _client()
        n = self._next
        ops = [(op[0], op[1], self.portable(op[2]), op[3]) if op[0] == "add" else op for op in ops]
        client.key_value_set_bytes(f"{_PREFIX}{n}", pickle.dumps({"ops": ops, "step": step, "stop": stop,
                                                                   "after": after}))
        if n >= _WINDOW:
            try:
                client.key_value_delete(f"{_PREFIX}{n - _WINDOW}")
            except Exception:  # noqa: BLE001 - housekeeping only
                pass
        self._next = n + 1

    @staticmethod
    def digest(outputs: list) -> str:
        """A digest of one step's outputs (each request's id, new tokens and
        finish): equal on every process while they stay in lockstep."""
        facts = [(o.request_id, tuple(int(t) for t in o.new_token_ids), o.finish_reason) for o in outputs]
        return hashlib.blake2b(repr(facts).encode(), digest_size=16).hexdigest()

    @staticmethod
    def portable(kwargs: dict) -> dict:
        """A request's options as they travel: a context-free grammar's
        llguidance tokenizer cannot be pickled, so its
        :class:`~jaxkv.serve.grammar.HostGrammar` goes as its text
        (:meth:`~jaxkv.serve.grammar.HostGrammar.text`), bound again to the
        follower's own tokenizer (:meth:`bound`)."""
        from jaxkv.serve.grammar import HostGrammar

        constraint = kwargs.get("constraint")
        return dict(kwargs, constraint=constraint.text()) if isinstance(constraint, HostGrammar) else kwargs

    @staticmethod
    def bound(kwargs: dict, engine) -> dict:
        """:meth:`portable`'s undone on a follower: a grammar's text made a
        :class:`~jaxkv.serve.grammar.HostGrammar` over ``engine``'s tokenizer."""
        from jaxkv.serve.grammar import GrammarText

        constraint = kwargs.get("constraint")
        if isinstance(constraint, GrammarText):
            return dict(kwargs, constraint=constraint.bind(engine.tokenizer))
        return kwargs

    def unsendable(self, kwargs: dict) -> Exception | None:
        """Why a request's options cannot be sent to the followers (an
        ``InvalidArgument`` to answer), or None."""
        from jaxkv.errors import InvalidArgument

        try:
            pickle.dumps(self.portable(kwargs))
        except Exception as error:  # noqa: BLE001 - any reason pickle gives
            return InvalidArgument(f"this server runs across processes and this request's options cannot be sent "
                                   f"to the others ({type(error).__name__}: {error})")
        return None

    # ------------------------------------------------------------ followers

    def _read(self, n: int, poll: float) -> dict:
        client = _client()
        while True:
            try:
                return pickle.loads(client.blocking_key_value_get_bytes(f"{_PREFIX}{n}", int(poll * 1000)))
            except Exception as error:  # noqa: BLE001 - a timeout, or the service gone
                text = str(error)
                if "DEADLINE_EXCEEDED" not in text and "deadline" not in text.lower():
                    raise LostProcess(f"process {self.process_id}: the leader (process 0) is gone: the "
                                      f"coordination service answers {text.splitlines()[0][:200]}") from None
            try:
                live = alive(self.num_processes)
            except Exception as error:  # noqa: BLE001
                raise LostProcess(f"process {self.process_id}: the coordination service is gone ({error})") from None
            if 0 not in live:
                raise LostProcess(f"process {self.process_id}: the leader (process 0) is not alive")

    def follow(self, engine, *, poll: float = 1.0) -> int:
        """Run ``engine`` as the leader runs its own, record by record, until
        the leader's stop (returns 0). Raises :class:`LostProcess` when the
        leader dies, and ``RuntimeError`` when this engine leaves lockstep
        (a request id, or a step's outputs, that differ from the leader's)."""
        n, last = 0, None
        while True:
            record = self._read(n, poll)
            n += 1
            if record.get("after") is not None and record["after"] != last:
                raise RuntimeError(f"process {self.process_id} left lockstep before record {n - 1}: its last "
                                   f"step's outputs differ from the leader's (digest {last}, the leader's "
                                   f"{record['after']})")
            if record["stop"]:
                close = getattr(engine, "close", None)
                if close is not None:
                    close()
                return 0
            for op in record["ops"]:
                if op[0] == "add":
                    _, prompt, kwargs, want = op
                    try:
                        rid = engine.add_request(prompt, **self.bound(kwargs, engine))
                    except Exception:  # noqa: BLE001 - refused here as on the leader
                        rid = None
                    if rid != want:
                        raise RuntimeError(f"process {self.process_id} left lockstep at record {n - 1}: its "
                                           f"request id {rid}, the leader's {want}")
                elif op[0] == "abort":
                    try:
                        engine.abort(op[1])
                    except Exception:  # noqa: BLE001 - finished meanwhile, as on the leader
                        pass
            if record["step"]:
                try:
                    outputs = engine.step()
                except Exception:  # noqa: BLE001 - the leader fails these requests; its aborts come next
                    logger.exception("engine step failed on process %d (the leader aborts its requests)",
                                     self.process_id)
                    outputs = []
                last = self.digest(outputs)
                for output in outputs:
                    if output.finished:
                        try:
                            engine.forget(output.request_id)
                        except Exception:  # noqa: BLE001
                            pass


def watch(num_processes: int, on_lost: Callable[[str], None], *, poll: float = _WATCH_POLL) -> threading.Thread:
    """Start the leader's watchdog: ``on_lost(message)`` once, from its
    thread, when a process is no longer alive (module docstring)."""

    def run():
        while True:
            time.sleep(poll)
            try:
                live = alive(num_processes)
            except Exception as error:  # noqa: BLE001
                on_lost(f"the coordination service cannot be asked which processes are alive: {error}")
                return
            gone = sorted(set(range(num_processes)) - live)
            if gone:
                on_lost(f"process(es) {gone} of {num_processes} died (no longer alive in the jax.distributed run)")
                return

    thread = threading.Thread(target=run, name="jaxkv-watchdog", daemon=True)
    thread.start()
    return thread
