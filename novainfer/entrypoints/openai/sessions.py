"""Server-side chat sessions: a conversation's messages kept under a ``session_id``, per owner.

A chat request with a ``session_id`` gets the stored messages prepended to its own, and the
assistant's reply is appended afterwards, so a client may send only the new turn.

Every session belongs to the principal that made it (its API key, else its address): ids live in
that principal's namespace, so another principal's id is simply not found there (404, never
403), and each principal has its own quota (least recently used evicted first), so one client's
sessions never evict another's. Idle sessions older than the TTL are gone. A new session's id is
issued by the server (:meth:`SessionStore.create`, 128 random bits) unless the client names one.

Turns of one session are serialized by a per-session lock; the store itself is used only from
one thread (the event loop, or the session service's thread), so it needs no thread locking.

With several API server processes (``--api-server-count``) the sessions must be one store: the
supervisor serves a :class:`SessionStore` on a thread (:func:`start_session_service`, over a ZMQ
``ipc://`` socket in a private temporary directory, so only this user can reach it), and each API
server uses a :class:`RemoteSessionStore` on its address, which has the same interface. Its calls
are blocking round trips of well under a millisecond, acceptable on the event loop for session
routes; an unreachable service raises :class:`SessionServiceError` (a 500) after ``timeout_s``.
Turns are then serialized across processes by a lease held in the service (see
:class:`SharedSessionLock`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)


@dataclass
class Session:
    id: str
    model: str
    messages: list[dict[str, str]] = field(default_factory=list)
    created: float = field(default_factory=time.time)  # wall clock, for display
    last_used: float = field(default_factory=time.time)
    last_used_monotonic: float = field(default_factory=time.monotonic)  # for the TTL


class SessionStore:
    def __init__(self, max_sessions: int = 1024, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if not ttl_s > 0:
            raise ValueError(f"session ttl must be > 0 seconds, got {ttl_s}")
        self.max_sessions = max_sessions  # per owner
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_owner: dict[str, OrderedDict[str, Session]] = {}
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        for owner in list(self._by_owner):
            sessions = self._by_owner[owner]
            while sessions:  # oldest first: stop at the first one still alive
                oldest = next(iter(sessions.values()))
                if oldest.last_used_monotonic > deadline:
                    break
                sessions.popitem(last=False)
            if not sessions:
                del self._by_owner[owner]

    def _sessions(self, owner: str) -> OrderedDict[str, Session]:
        self._expire()
        return self._by_owner.get(owner, OrderedDict())

    def get(self, owner: str, session_id: str) -> Session | None:
        return self._sessions(owner).get(session_id)

    def save(self, owner: str, session_id: str, model: str, messages: list[dict[str, str]]) -> Session:
        """Stores (replaces) a session's messages and marks it most recently used."""
        self._expire()
        sessions = self._by_owner.setdefault(owner, OrderedDict())
        session = sessions.pop(session_id, None)
        if session is None:
            session = Session(session_id, model)
        session.model, session.messages = model, list(messages)
        session.last_used, session.last_used_monotonic = time.time(), self._clock()
        sessions[session_id] = session
        while len(sessions) > self.max_sessions:
            sessions.popitem(last=False)
        return session

    def create(self, owner: str, model: str) -> Session:
        """A new empty session under an id issued here (128 random bits)."""
        return self.save(owner, secrets.token_hex(16), model, [])

    def delete(self, owner: str, session_id: str) -> bool:
        return self._sessions(owner).pop(session_id, None) is not None

    def list(self, owner: str) -> list[Session]:
        """The owner's sessions, most recently used first."""
        return list(reversed(self._sessions(owner).values()))

    def __len__(self) -> int:
        self._expire()
        return sum(len(s) for s in self._by_owner.values())

    def lock(self, owner: str, session_id: str) -> asyncio.Lock:
        """The lock that serializes turns of one session; it lives as long as someone holds it."""
        return _local_lock(self._locks, (owner, session_id))


def _local_lock(locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock],
                key: tuple[str, str]) -> asyncio.Lock:
    """The process's asyncio.Lock of one session, made on first use."""
    lock = locks.get(key)
    if lock is None:
        lock = asyncio.Lock()
        locks[key] = lock
    return lock


# ---- one store for several processes ------------------------------------------------------------------------
DEFAULT_LEASE_S = 30.0
DEFAULT_TIMEOUT_S = 2.0
_POLL_FIRST_S, _POLL_MAX_S = 0.002, 0.05  # a waiting turn polls the lease, backing off up to this
_STOP_CHECK_MS = 100  # how often the service thread looks whether it should stop


# Calls and replies travel as msgpack: a long conversation's messages cross twice per chat turn.
# (The module's functions, not shared Encoder objects: the service's thread and its callers encode.)
_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


class SessionServiceError(RuntimeError):
    """The session service did not answer or failed a call (the server answers 500 and logs it)."""


@dataclass
class _Lease:
    holder: str
    expires: float  # on the service's clock


class _SessionHost:
    """The service's side: one SessionStore and the turn leases, used only by the service thread.

    Its methods named in ``CALLS`` are what a RemoteSessionStore may call; they take and return
    plain values (msgpack)."""

    CALLS = frozenset({"get", "save", "create", "delete", "list", "count", "try_acquire", "release"})

    def __init__(self, store: SessionStore, lease_s: float, clock: Callable[[], float]) -> None:
        self.store = store
        self.lease_s = lease_s
        self._clock = clock
        self._leases: dict[tuple[str, str], _Lease] = {}

    def get(self, owner: str, session_id: str) -> dict[str, Any] | None:
        session = self.store.get(owner, session_id)
        return None if session is None else asdict(session)

    def save(self, owner: str, session_id: str, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
        return asdict(self.store.save(owner, session_id, model, messages))

    def create(self, owner: str, model: str) -> dict[str, Any]:
        return asdict(self.store.create(owner, model))

    def delete(self, owner: str, session_id: str) -> bool:
        return self.store.delete(owner, session_id)

    def list(self, owner: str) -> list[dict[str, Any]]:
        return [asdict(session) for session in self.store.list(owner)]

    def count(self) -> int:
        return len(self.store)

    def try_acquire(self, owner: str, session_id: str, holder: str) -> float | None:
        """Grants the turn lease of a session (or renews it, to its holder): its length in seconds;
        None while another holder has it."""
        now = self._clock()
        # Leases of holders that crashed lapse here (they are as many as turns were running).
        self._leases = {key: lease for key, lease in self._leases.items() if lease.expires > now}
        lease = self._leases.get((owner, session_id))
        if lease is not None and lease.holder != holder:
            return None
        self._leases[(owner, session_id)] = _Lease(holder, now + self.lease_s)
        return self.lease_s

    def release(self, owner: str, session_id: str, holder: str) -> bool:
        """Ends the holder's lease; False if it was not (or no longer) theirs."""
        lease = self._leases.get((owner, session_id))
        if lease is None or lease.holder != holder:
            return False
        del self._leases[(owner, session_id)]
        return True

    def answer(self, request: bytes) -> bytes:
        """One call's reply, ``{"ok": result}`` or ``{"error": why}``: a bad call never stops the service."""
        try:
            call = _decode(request)
            name, args = call["call"], call["args"]
            if name not in self.CALLS:
                raise ValueError(f"unknown call {name!r}")
            return _encode({"ok": getattr(self, name)(*args)})
        except Exception as exc:
            logger.exception("session service: a call failed")
            return _encode({"error": f"{type(exc).__name__}: {exc}"})


class SessionService:
    """A SessionStore served on a thread of this process (the supervisor), at :attr:`address`.

    The socket lives in a new private directory (mode 0700: only this user can connect), which
    :meth:`shutdown` removes."""

    def __init__(self, host: _SessionHost) -> None:
        self._dir = tempfile.mkdtemp(prefix="novainfer-sessions-")
        self.address = f"ipc://{os.path.join(self._dir, 'sessions.sock')}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as exc:
            self._close()
            raise SessionServiceError(f"cannot serve sessions at {self.address}: {exc}") from exc
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(host,), name="session-service", daemon=True)
        self._thread.start()

    def _serve(self, host: _SessionHost) -> None:
        try:
            while not self._stopping.is_set():
                if self._socket.poll(_STOP_CHECK_MS):
                    *envelope, request = self._socket.recv_multipart()
                    self._socket.send_multipart([*envelope, host.answer(request)])
        except Exception:  # the API servers' calls now time out, and say where
            logger.exception("the session service at %s stopped", self.address)

    def _close(self) -> None:
        self._socket.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def shutdown(self) -> None:
        """Stops serving (within 0.1 s) and removes the socket's directory; calls then fail."""
        self._stopping.set()
        self._thread.join()
        self._close()


def start_session_service(max_sessions: int, ttl_s: float, *, lease_s: float = DEFAULT_LEASE_S,
                          clock: Callable[[], float] = time.monotonic) -> SessionService:
    """Serves one :class:`SessionStore` (same limits and TTL rules) to :class:`RemoteSessionStore` s
    in other processes, until :meth:`SessionService.shutdown`. ``lease_s``: how long a turn's lease
    outlives its holder's last renewal (see :class:`SharedSessionLock`)."""
    if not lease_s > 0:
        raise ValueError(f"session lease must be > 0 seconds, got {lease_s}")
    return SessionService(_SessionHost(SessionStore(max_sessions, ttl_s, clock), lease_s, clock))


class SharedSessionLock:
    """Serializes turns of one session across API server processes; used like an asyncio.Lock
    (``await acquire()``, then ``release()``).

    It takes the process's own asyncio.Lock of the session first, so turns within one process
    queue without polling, then the session's lease in the service, polling for it (every 2 ms,
    backing off to 50 ms) while another process holds it. The holder renews the lease every third
    of ``lease_s`` (30 s by default) while it holds it, so a long turn keeps it, and the lease of a
    holder that crashed lapses within ``lease_s``."""

    def __init__(self, call: Callable[..., Any], local: asyncio.Lock, owner: str, session_id: str) -> None:
        self._call = call
        self._local = local
        self._key = (owner, session_id)
        self._holder = secrets.token_hex(16)
        self._renewal: asyncio.TimerHandle | None = None

    async def acquire(self) -> bool:
        await self._local.acquire()
        try:
            lease_s = await self._wait_for_lease()
        except BaseException:  # failed or cancelled: this turn never started, so the next one may
            self._local.release()
            raise
        self._renew_in(lease_s)
        return True

    def release(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
        try:
            self._call("release", *self._key, self._holder)
        finally:
            self._local.release()

    async def _wait_for_lease(self) -> float:
        delay = _POLL_FIRST_S
        while (lease_s := self._try_acquire()) is None:
            await asyncio.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)
        return lease_s

    def _try_acquire(self) -> float | None:
        return self._call("try_acquire", *self._key, self._holder)

    def _renew_in(self, lease_s: float) -> None:
        self._renewal = asyncio.get_running_loop().call_later(lease_s / 3, self._renew)

    def _renew(self) -> None:
        try:
            lease_s = self._try_acquire()
        except SessionServiceError:
            logger.warning("could not renew the turn lease of session %s", self._key[1], exc_info=True)
            return
        if lease_s is None:  # it lapsed (this loop stalled for lease_s) and another turn took it
            logger.warning("the turn lease of session %s lapsed while its turn ran", self._key[1])
            return
        self._renew_in(lease_s)


class RemoteSessionStore:
    """The interface of :class:`SessionStore`, served by a :class:`SessionService` at ``address``
    (in another process). Sessions it returns are copies. Each call is a blocking round trip
    (well under a millisecond); one the service does not answer within ``timeout_s`` raises
    :class:`SessionServiceError`. Use it from one thread (the event loop)."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def get(self, owner: str, session_id: str) -> Session | None:
        found = self._call("get", owner, session_id)
        return None if found is None else Session(**found)

    def save(self, owner: str, session_id: str, model: str, messages: list[dict[str, str]]) -> Session:
        """Stores (replaces) a session's messages and marks it most recently used."""
        return Session(**self._call("save", owner, session_id, model, messages))

    def create(self, owner: str, model: str) -> Session:
        """A new empty session under an id issued by the service (128 random bits)."""
        return Session(**self._call("create", owner, model))

    def delete(self, owner: str, session_id: str) -> bool:
        return self._call("delete", owner, session_id)

    def list(self, owner: str) -> list[Session]:
        """The owner's sessions, most recently used first."""
        return [Session(**found) for found in self._call("list", owner)]

    def __len__(self) -> int:
        return self._call("count")

    def lock(self, owner: str, session_id: str) -> SharedSessionLock:
        """The lock that serializes turns of one session, across processes."""
        return SharedSessionLock(self._call, _local_lock(self._locks, (owner, session_id)), owner, session_id)

    def close(self) -> None:
        self._disconnect()
        self._context.term()

    def _call(self, name: str, *args: Any) -> Any:
        if self._socket is None:
            self._socket = self._context.socket(zmq.REQ)
            self._socket.setsockopt(zmq.LINGER, 0)  # a dead service must not hold up close()
            self._socket.connect(self.address)
        try:
            self._socket.send(_encode({"call": name, "args": args}), zmq.NOBLOCK)
            if not self._socket.poll(self.timeout_s * 1000):
                raise TimeoutError(f"no answer within {self.timeout_s} s")
            reply = _decode(self._socket.recv())
        except (zmq.ZMQError, TimeoutError) as exc:
            self._disconnect()
            raise SessionServiceError(f"session service at {self.address}: call '{name}' failed: {exc}") from exc
        except BaseException:
            self._disconnect()
            raise
        if "error" in reply:
            raise SessionServiceError(f"session service at {self.address}: call '{name}' failed there: "
                                      f"{reply['error']}")
        return reply["ok"]

    def _disconnect(self) -> None:
        # A REQ socket that missed its reply can send no more: the next call connects afresh.
        if self._socket is not None:
            self._socket.close()
            self._socket = None
