"""Concurrent programs: the logical cores of an LNC2 launch (and the ranks of a multi-rank launch) run
CONCURRENTLY, so cross-core instructions (``nisa.core_barrier``, ``nisa.sendrecv``, ``nki.collectives``)
exchange data as on hardware.

Each program runs in its own thread, but only one runs at a time and the order is deterministic: a program
runs until it finishes or waits at a rendezvous (a barrier, a send/receive, a collective); then the lowest-
numbered program that can proceed runs (rank-major, program-minor). A kernel with no cross-core instruction
therefore runs exactly as before: program 0 to its end, then program 1. When nothing can proceed while some
program still waits, the launch fails naming each program's wait (a deadlock on hardware).

``meet(key, participants, payload)`` is the one primitive: the calling program posts ``payload`` under
``key`` and waits until every program in ``participants`` posted under the same key; it returns every
participant's payload. Keys carry a per-program sequence number (the k-th barrier, the k-th send on a pipe),
so the n-th call of each participant meets the n-th call of the others.

A program is identified by ``(rank, pid)``; a single launch is rank 0. This module imports ``runtime`` only.
"""
from __future__ import annotations

import sys
import threading

from . import runtime as _rt
from .errors import NkiValidationError

__all__ = ["World", "meet", "NkiDeadlockError"]

_STACK = 256 * 1024 * 1024  # production kernels recurse deeply (nki-library's transformer_tkg notes a stack limit)


class NkiDeadlockError(NkiValidationError):
    """Every program that has not finished waits at a rendezvous no other program will reach."""


class _Abort(BaseException):
    """Raised inside a waiting program when the launch failed elsewhere (ends its thread quietly)."""


class _Task:
    __slots__ = ("prog", "fn", "state", "wake", "waits_for", "result", "thread")

    def __init__(self, prog, fn):
        self.prog = prog
        self.fn = fn
        self.state = "ready"    # ready | blocked | done
        self.wake = None        # blocked: callable -> bool
        self.waits_for = ""
        self.result = None
        self.thread = None


class World:
    """The programs of one launch (or of every rank of a multi-rank launch)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.tasks = []
        self.running = None
        self.error = None
        self.posts = {}   # key -> {program id: payload}

    def add(self, prog, fn):
        t = _Task(prog, fn)
        prog.world = self
        prog.task = t
        self.tasks.append(t)
        return t

    # -- running --------------------------------------------------------------------------------------
    def run(self):
        """Run every task to completion; re-raise the first failure. Returns the tasks' results in order."""
        if len(self.tasks) == 1:
            t = self.tasks[0]
            self.running = t
            _rt.set_current(t.prog)
            try:
                t.result = t.fn()
            finally:
                _rt.set_current(None)
                self.running = None
            t.state = "done"
            return [t.result]
        old = threading.stack_size()
        try:
            threading.stack_size(_STACK)
            for t in self.tasks:
                t.thread = threading.Thread(target=self._body, args=(t,), daemon=True,
                                            name=f"nki-program-{t.prog.rank}.{t.prog.pid}")
                t.thread.start()
        finally:
            threading.stack_size(old)
        with self.cv:
            self.running = self._pick()
            self.cv.notify_all()
            while self.error is None and not all(t.state == "done" for t in self.tasks):
                self.cv.wait()
        for t in self.tasks:
            t.thread.join()
        _rt.set_current(None)
        if self.error is not None:
            raise self.error[1].with_traceback(self.error[2])
        return [t.result for t in self.tasks]

    def _body(self, t):
        with self.cv:
            while self.running is not t and self.error is None:
                self.cv.wait()
            if self.error is not None:
                return
            _rt.set_current(t.prog)
        try:
            t.result = t.fn()
        except _Abort:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            with self.cv:
                if self.error is None:
                    self.error = (type(e), e, e.__traceback__)
                self.cv.notify_all()
            return
        with self.cv:
            t.state = "done"
            self._switch()

    def _pick(self):
        for t in self.tasks:
            if t.state == "ready" or (t.state == "blocked" and t.wake()):
                return t
        return None

    def _switch(self):
        """Hand the turn to the next program that can proceed (the caller holds ``cv``)."""
        nxt = self._pick()
        self.running = nxt
        if nxt is None and self.error is None and not all(t.state == "done" for t in self.tasks):
            lines = [f"program {t.prog.rank}.{t.prog.pid}: " + (t.waits_for if t.state == "blocked" else t.state)
                     for t in self.tasks]
            e = NkiDeadlockError("the programs of this launch deadlock: every unfinished program waits at a "
                                 "rendezvous no other program will reach\n  " + "\n  ".join(lines))
            self.error = (type(e), e, None)
        self.cv.notify_all()

    def block(self, wake, waits_for):
        """Called by the running program: wait until ``wake()`` holds, letting the others run meanwhile."""
        t = _rt.current().task
        if wake():
            return
        with self.cv:
            t.state, t.wake, t.waits_for = "blocked", wake, waits_for
            self._switch()
            while self.running is not t and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise _Abort()
            t.state, t.wake, t.waits_for = "ready", None, ""
            _rt.set_current(t.prog)

    # -- rendezvous -----------------------------------------------------------------------------------
    def meet(self, key, participants, payload, what):
        """Post ``payload`` under ``key`` and wait for every participant's post; return {participant: payload}."""
        prog = _rt.current()
        me = (prog.rank, prog.pid)
        participants = tuple(participants)
        if me not in participants:
            raise NkiValidationError(f"{what}: program {me} is not among the participants {participants}")
        known = {(t.prog.rank, t.prog.pid) for t in self.tasks}
        missing = [p for p in participants if p not in known]
        if missing:
            raise NkiValidationError(f"{what}: participant(s) {missing} are not programs of this launch (programs: "
                                     f"{sorted(known)}); launch with kernel[2] for two logical cores")
        posted = self.posts.setdefault(key, {})
        if me in posted:
            raise NkiValidationError(f"{what}: program {me} posted twice under {key!r}")
        posted[me] = payload
        self.block(lambda: all(p in posted for p in participants),
                   f"{what} waits for program(s) " + ", ".join(f"{p[0]}.{p[1]}" for p in participants
                                                               if p not in posted))
        return {p: posted[p] for p in participants}


def meet(key, participants, payload, what):
    """``World.meet`` of the running program's world."""
    prog = _rt.current()
    return prog.world.meet(key, participants, payload, what)


def next_seq(prog, kind):
    """The per-program sequence number of the next ``kind`` rendezvous (0, 1, ...)."""
    n = prog.sync_seq.get(kind, 0)
    prog.sync_seq[kind] = n + 1
    return n


def _stack_ok():  # pragma: no cover - diagnostics only
    return sys.getrecursionlimit()
