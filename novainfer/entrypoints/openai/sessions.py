"""Server-side chat sessions: a conversation's messages kept under a ``session_id``, per owner.

A chat request with a ``session_id`` gets the stored messages prepended to its own, and the
assistant's reply is appended afterwards, so a client may send only the new turn.

Every session belongs to the principal that made it (its API key, else its address): ids live in
that principal's namespace, so another principal's id is simply not found there (404, never
403), and each principal has its own quota (least recently used evicted first), so one client's
sessions never evict another's. Idle sessions older than the TTL are gone. A new session's id is
issued by the server (:meth:`SessionStore.create`, 128 random bits) unless the client names one.

Turns of one session are serialized by a per-session lock; the store itself is used only from
the event loop, so it needs no thread locking.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


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
        key = (owner, session_id)
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock
