"""Server-side chat sessions: a conversation's messages kept under a client-chosen ``session_id``.

A chat request with a ``session_id`` gets the stored messages prepended to its own, and the
assistant's reply is appended afterwards, so a client may send only the new turn. Sessions are
bounded in number (least recently used evicted first) and in age (idle longer than the TTL:
gone). Turns of one session are serialized by a per-session lock; the store itself is used only
from the event loop, so it needs no thread locking.
"""

from __future__ import annotations

import asyncio
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
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        # Oldest first: stop at the first one still alive.
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used_monotonic > deadline:
                break
            self._sessions.popitem(last=False)

    def get(self, session_id: str) -> Session | None:
        self._expire()
        return self._sessions.get(session_id)

    def save(self, session_id: str, model: str, messages: list[dict[str, str]]) -> Session:
        """Stores (replaces) a session's messages and marks it most recently used."""
        self._expire()
        session = self._sessions.pop(session_id, None)
        if session is None:
            session = Session(session_id, model)
        session.model, session.messages = model, list(messages)
        session.last_used, session.last_used_monotonic = time.time(), self._clock()
        self._sessions[session_id] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session

    def delete(self, session_id: str) -> bool:
        self._expire()
        return self._sessions.pop(session_id, None) is not None

    def list(self) -> list[Session]:
        """Sessions, most recently used first."""
        self._expire()
        return list(reversed(self._sessions.values()))

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions)

    def lock(self, session_id: str) -> asyncio.Lock:
        """The lock that serializes turns of one session; it lives as long as someone holds it."""
        lock = self._locks.get(session_id)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[session_id] = lock
        return lock
