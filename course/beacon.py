"""Course plumbing: where every rank is, readable by the others, so that a rank that gave up waiting
in a collective can name the ranks that never came, and the last step each reported.

Each rank keeps a key in the run's own store: torch.distributed's TCPStore at
MASTER_ADDR:MASTER_PORT (torchrun's agent holds it, else rank 0's process), or, for the Horovod
lessons, `horovodrun --gloo`'s rendezvous server. The key holds its last training step
(course/watch.POSITION), its host and pid, and the time. A thread of its own writes it when the step
changes and at least once a second, so the key stays fresh while the rank waits in a collective
(the wait releases the interpreter) and goes stale when the rank is stopped, hung in a loop that
holds the interpreter, or dead. The thread has its own connection to the store: it never waits on
the lesson's.

PyTorch's Flight Recorder does this for NCCL (TORCH_NCCL_TRACE_BUFFER_SIZE, diagnose/hangs.md);
for gloo the course does it itself. Horovod under mpiexec has no store: stacks.py is the way there.
"""
import contextlib
import json
import os
import re
import socket
import threading
import time
from datetime import timedelta

from course import watch

BEAT_S = 1.0  # at least one write a second
SILENT_S = 5.0  # a key older than this: the rank has stopped answering
_BEACON = []
_READ = []  # (the store, the ranks still answering) once absent() has read it


def _key(rank, what="at"):
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted attempt: new keys
    return f"course-beacon-{attempt}-{what}-{rank}"


class _TCPStore:
    """torch.distributed's store at MASTER_ADDR:MASTER_PORT (env://), through a connection of our
    own."""

    def __init__(self, timeout_s):
        from torch.distributed import TCPStore
        self.store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None,
                              False, timedelta(seconds=timeout_s), wait_for_workers=False)

    def put(self, key, value):
        self.store.set(key, value)

    def read(self, key):
        return self.store.get(key).decode() if self.store.check([key]) else None


class _HorovodKV:
    """`horovodrun --gloo`'s rendezvous server: an HTTP key-value store (PUT and GET /scope/key)."""

    def __init__(self, timeout_s):
        addr, port = (os.environ[f"HOROVOD_GLOO_RENDEZVOUS_{v}"] for v in ("ADDR", "PORT"))
        self.url, self.timeout_s = f"http://{addr}:{port}/course/", timeout_s

    def put(self, key, value):
        from urllib.request import Request, urlopen
        urlopen(Request(self.url + key, data=value.encode(), method="PUT"),
                timeout=self.timeout_s).read()

    def read(self, key):
        from urllib.error import HTTPError
        from urllib.request import urlopen
        try:
            return urlopen(self.url + key, timeout=self.timeout_s).read().decode()
        except HTTPError as e:
            if e.code == 404:
                return None
            raise


def _client(timeout_s):
    """A connection of our own to the run's store, or None: torch.distributed's (env://), else
    horovodrun's; Horovod under mpiexec has none."""
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ:
        return _HorovodKV(timeout_s)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return _TCPStore(timeout_s)
    return None


class _Beacon(threading.Thread):
    def __init__(self, rank, world, store):
        super().__init__(name="course-beacon", daemon=True)
        self.rank, self.world, self.store, self.stopped = rank, world, store, False
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.moved = threading.Event()  # set at each new step (watch.MOVED)

    def beat(self):
        self.moved.clear()
        now = {k: v for k, v in watch.POSITION.items() if k != "at"}
        self.store.put(_key(self.rank), json.dumps(
            {**now, "host": self.host, "pid": self.pid, "time": time.time()}))

    def run(self):
        while not self.stopped:
            self.moved.wait(BEAT_S)
            try:
                self.beat()
            except Exception:  # the store is gone (the run ended, or its host died): stop beating
                return


def start(rank, world):
    """Once the rank has joined (plumbing wraps init_process_group and hvd.init): start beating.
    Never fails the run: without a store the report says less, nothing else changes."""
    if _BEACON or world < 2:
        return
    try:
        store = _client(timeout_s=5)
        beacon = store and _Beacon(rank, world, store)
        if beacon:
            beacon.beat()  # the first one now: a rank that stops right after joining has one
    except Exception:
        return
    if beacon:
        _BEACON.append(beacon)
        watch.MOVED.append(beacon.moved.set)
        beacon.start()


def stop():
    for beacon in _BEACON:
        beacon.stopped = True
        beacon.moved.set()


def _where(p):
    if not p.get("epoch"):
        return "before its first training step"
    return f"in epoch {p['epoch']} after step {p['step']}/{p['total']}"


def absent(me):
    """Who the waiting rank `me` was likely waiting for, in words ('rank 2 (silent 11 s in epoch 1
    after step 3/31; pid 812 on nid0001)'), or None when the store cannot tell. Ranks whose key has
    gone stale come first; failing those, the ranks behind `me` (alive, elsewhere in the code)."""
    if not _BEACON:
        return None
    stop()
    try:
        store = _client(timeout_s=3)
        keys = {r: _key(r) for r in range(_BEACON[0].world) if r != me}
        seen = {r: json.loads(value) for r, k in keys.items() if (value := store.read(k))}
    except Exception:  # rank 0's process holds the store under mpiexec: stopped too?
        if me != 0 and _rank_0_holds_it():
            return "rank 0 perhaps (its process holds the run's store, which does not answer)"
        return None
    with contextlib.suppress(Exception):
        store.put(_key(me, "read"), "1")  # (rank 0 holding the store waits for it: linger())
    now, mine = time.time(), dict(watch.POSITION)
    age = {r: now - p["time"] for r, p in seen.items()}
    silent = {r: a for r, a in age.items() if a > SILENT_S}
    _READ[:] = [(store, [r for r in seen if r not in silent])]

    def order(p):
        return (p.get("epoch") or 0, p.get("step") or 0)

    never = [r for r in keys if r not in seen]
    behind = [r for r, p in seen.items() if r not in silent and order(p) < order(mine)]

    def who(r, p, state):
        return f"rank {r} ({state} {_where(p)}; pid {p['pid']} on {p['host']})"
    named = ([f"rank {r} (never reported: it never joined)" for r in never] +
             [who(r, seen[r], f"silent {silent[r]:.0f} s") for r in sorted(silent)])
    if not named:
        named = [who(r, seen[r], "answering, but behind:") for r in behind]
    if not named:
        return None
    return ", ".join(named[:-1]) + (" and " if len(named) > 1 else "") + named[-1]


def refuse(me, line):
    """This rank refused (bad input found after it joined): its line, in the run's store, so that a
    peer that then loses it says why (refusal()) instead of "lost contact"."""
    if _BEACON:
        stop()
        with contextlib.suppress(Exception):
            _client(timeout_s=3).put(_key(me, "refused"), line[:400])


def refusal(me):
    """'rank R refused: its line' for a peer of `me` that refused, or None."""
    with contextlib.suppress(Exception):
        store = _BEACON and _client(timeout_s=3)
        for r in range(_BEACON[0].world) if store else ():
            if r != me and (line := store.read(_key(r, "refused"))):
                return f"rank {r} refused: {line}"
    return None


def linger(me, wait_s=5.0):
    """Rank 0 outside torchrun holds the store in its own process: before it leaves, it waits (at
    most wait_s) until the other ranks still answering have read it, so that they too can name the
    silent ones."""
    if me != 0 or not _rank_0_holds_it() or not _READ:
        return
    store, answering = _READ[0]
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(Exception):
        while time.monotonic() < deadline and not all(
                store.read(_key(r, "read")) for r in answering):
            time.sleep(0.1)


def _rank_0_holds_it():  # (torchrun's agent and horovodrun hold the store themselves)
    return not any(v in os.environ for v in ("TORCHELASTIC_RUN_ID", "HOROVOD_GLOO_RENDEZVOUS_ADDR"))


def never_joined(text, rank):
    """Who never joined, as far as the timeout's own text tells: gloo waits for the key each rank
    publishes (`.../0/K`, as under torchrun, whose agent holds the store), and rank 0, holding the
    store itself (mpiexec, srun), counts the ranks that reached it ("2/3 clients joined")."""
    keys = re.search(r"keys: (\S+)", text)
    missing = sorted({int(k) for k in re.findall(r"/(\d+)(?=[,\]\s]|$)", keys.group(1))}) if keys else []
    if missing and 0 not in missing and rank not in missing:  # (rank 0's key: it waits itself)
        return f"rank {', '.join(map(str, missing))}, which never joined it"
    if counted := re.search(r"(\d+)/(\d+) clients joined", text):
        joined, size = map(int, counted.groups())
        return f"{size - joined} of the {size} ranks, which never joined it"
    return "a rank that never joined it"
