"""Serving across processes when something goes wrong
(:mod:`jaxkv.serve.multihost`, the server's engine thread
:class:`jaxkv.serve.http.EngineLoop`).

**A process dies.** A step whose collectives meet a dead process fails at
once, but the watchdog names the dead process only within the heartbeat
timeout. The engine thread must wait for that verdict: every request in
flight, queued or sent later then gets the lost process's 503, never the
failed step's own error (500); and a failed step with no process lost
still fails its requests with the engine's error once the wait is over.

**A follower leaves lockstep.** Each record carries the digest of the
leader's last step's outputs: a follower whose own differ stops with the
reason at the next record, instead of serving on out of step.

Here the engines and the run's record stream are stand-ins (the real two
processes are test_server_processes, ``long``): the engine's step fails
as a collective does, either contained (the engine re-queues, as
:mod:`jaxkv.serve.faults` does) or raised, and a thread plays the
watchdog after a drawn delay; the follower's engine draws its tokens from
the leader's seed, or from another.
"""

from __future__ import annotations

import asyncio
import secrets
import threading

import numpy as np
import pytest

from jaxkv.serve import multihost
from jaxkv.serve.http import APIError, EngineLoop, _Sink


class Lockstep:
    """The leader's record stream, published nowhere."""

    num_processes = 2

    def __init__(self, verdict_seconds: float):
        self.verdict_seconds = verdict_seconds
        self.published = 0

    def publish(self, ops, step, *, stop=False, after=None):
        self.published += 1

    digest = staticmethod(multihost.Lockstep.digest)

    @staticmethod
    def unsendable(kwargs):
        return None


class BrokenEngine:
    """An engine whose every step meets a dead peer: ``contained`` as the
    real engine's fault containment does (the error kept in
    ``last_failure``, nothing returned), else raised."""

    def __init__(self, contained: bool):
        self.contained = contained
        self.live: set[int] = set()
        self.next_id = 0
        self.steps = 0
        self.last_failure = None
        self.closed = False

    def add_request(self, prompt, **kwargs):
        self.next_id += 1
        self.live.add(self.next_id)
        return self.next_id

    def has_unfinished(self):
        return bool(self.live)

    def abort(self, rid):
        self.live.discard(rid)

    def forget(self, rid):
        pass

    def step(self):
        self.steps += 1
        error = RuntimeError("Gloo connection closed by peer [127.0.0.1]:1234")
        if not self.contained:
            raise error
        self.last_failure = error
        return []

    def close(self):
        self.closed = True


async def first_item(queue: asyncio.Queue, timeout: float = 30):
    """The first item that is not ``("added", id)``."""
    while True:
        _, item = await asyncio.wait_for(queue.get(), timeout)
        if not (isinstance(item, tuple) and item[0] == "added"):
            return item


@pytest.mark.parametrize("contained", [True, False])
def test_requests_get_the_lost_process_503_not_the_failed_step_error(contained):
    seed = secrets.randbelow(2**31)
    delay = float(np.random.default_rng(seed).uniform(0.05, 0.5))  # the watchdog's verdict, after the failure
    lost = APIError(503, "this server runs across 2 processes and process(es) [1] of 2 died", code="process_lost")

    async def scenario():
        engine = BrokenEngine(contained)
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop(), lockstep=Lockstep(verdict_seconds=30))
        loop.start()
        queue: asyncio.Queue = asyncio.Queue()
        sinks = [_Sink(queue, i) for i in range(3)]
        for sink in sinks:
            loop.add(sink, [1, 2, 3], {})
        threading.Timer(delay, loop.fail_all, args=(lost,)).start()
        answers = [await first_item(queue) for _ in sinks]
        later = asyncio.Queue()
        loop.add(_Sink(later, 0), [4, 5], {})  # sent after the verdict: answered, never left waiting
        call = asyncio.get_running_loop().create_future()
        loop.call(call, lambda e: "ran")
        late = await first_item(later)
        with pytest.raises(APIError):
            await asyncio.wait_for(call, 30)
        await asyncio.to_thread(loop.stop, 30)
        return engine, loop, answers, late

    engine, loop, answers, late = asyncio.run(scenario())
    assert [a[1] for a in answers] == [lost] * 3, (seed, answers)
    assert late == ("error", lost), seed
    assert not loop.thread.is_alive() and engine.closed, seed
    assert engine.steps == 1, (seed, engine.steps)  # never stepped again once a process was lost


@pytest.mark.parametrize("contained", [True, False])
def test_a_failed_step_with_every_process_alive_fails_with_the_engine_error(contained):
    async def scenario():
        engine = BrokenEngine(contained)
        loop = EngineLoop(lambda: engine, asyncio.get_running_loop(), lockstep=Lockstep(verdict_seconds=0.2))
        loop.start()
        queue: asyncio.Queue = asyncio.Queue()
        loop.add(_Sink(queue, 0), [1, 2, 3], {})
        if contained:  # the engine re-queues it and steps on; its fault limit is the engine's business
            while engine.steps < 2:
                await asyncio.sleep(0.05)
            answer = None
        else:
            answer = await first_item(queue)
        await asyncio.to_thread(loop.stop, 30)
        return engine, answer

    engine, answer = asyncio.run(scenario())
    if contained:
        assert engine.steps >= 2  # not stopped: the wait found every process alive
    else:
        assert answer[0] == "error" and "Gloo" in str(answer[1])


# ------------------------------------------------------------ a follower that leaves lockstep


class TokenEngine:
    """A follower's engine: each step gives every live request one token
    drawn from its own generator (the same seed: the same tokens as the
    leader's), or from another seed (a process that diverged)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.live: list[int] = []
        self.closed = False

    def add_request(self, prompt, **kwargs):
        self.live.append(len(self.live) + 1)
        return self.live[-1]

    def abort(self, rid):
        pass

    def forget(self, rid):
        pass

    def step(self):
        from types import SimpleNamespace

        return [SimpleNamespace(request_id=rid, new_token_ids=[int(self.rng.integers(1000))], finish_reason=None,
                                finished=False) for rid in self.live]

    def close(self):
        self.closed = True


def leader_records(seed: int, steps: int) -> list:
    """The records a leader publishes: two arrivals, ``steps`` steps, the
    stop; each carrying the digest of the leader's step before it."""
    leader = TokenEngine(seed)
    records, after = [], None
    for n in range(steps + 1):
        ops = [("add", [1, 2], {}, leader.add_request([1, 2])) for _ in range(2)] if n == 0 else []
        records.append({"ops": ops, "step": n < steps, "stop": n == steps, "after": after})
        if n < steps:
            after = multihost.Lockstep.digest(leader.step())
    return records


@pytest.mark.parametrize("diverged", [False, True])
def test_a_follower_whose_outputs_differ_from_the_leaders_stops(diverged, monkeypatch):
    """The leader sends the digest of its last step's outputs with each
    record (``Lockstep.digest``): a follower in step finishes at the stop;
    one whose tokens differ (another seed) stops at the next record with
    the reason, instead of serving on out of step."""
    seed = secrets.randbelow(2**31)
    records = leader_records(seed, steps=int(np.random.default_rng(seed).integers(2, 6)))
    lockstep = multihost.Lockstep(2, 1)
    monkeypatch.setattr(lockstep, "_read", lambda n, poll: records[n])
    follower = TokenEngine(seed + 1 if diverged else seed)
    if diverged:
        with pytest.raises(RuntimeError, match="left lockstep before record 1: its last step.s outputs differ"):
            lockstep.follow(follower)
    else:
        assert lockstep.follow(follower) == 0 and follower.closed
