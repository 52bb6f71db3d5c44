"""Sessions shared by several API server processes: one session service, a RemoteSessionStore in
this process and one in a spawned process (a second API server). The service's clock is the
test's, so TTLs and lease expiry never depend on the machine's speed."""

import asyncio
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import pytest
import zmq

from novainfer.entrypoints.openai.sessions import RemoteSessionStore, SessionService, SessionServiceError, \
    SessionStore, SharedSessionLock, start_session_service

LEASE_S = 30.0
PEER_TIMEOUT_S = 60.0  # the peer's first answer waits for its imports


def _peer_main(address: str, conn: Connection) -> None:
    """A second API server process: makes the store calls the test sends, until it sends None."""
    store = RemoteSessionStore(address)
    held: dict[tuple, SharedSessionLock] = {}

    async def serve() -> None:
        while (request := conn.recv()) is not None:
            name, args = request
            if name == "crash":  # dies holding what it holds, as a killed server would
                os._exit(1)
            if name == "acquire":
                held[args] = store.lock(*args)
                conn.send(await held[args].acquire())
            elif name == "release":
                conn.send(held.pop(args).release())
            else:
                conn.send(getattr(store, name)(*args))

    asyncio.run(serve())
    store.close()


class _Peer:
    """The RemoteSessionStore of a spawned process, called like one; ``acquire``/``release`` take a
    session's turn lock there."""

    def __init__(self, address: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_peer_main, args=(address, child), daemon=True)
        self.process.start()
        child.close()

    def call(self, name: str, *args):
        self._conn.send((name, args))
        if not self._conn.poll(PEER_TIMEOUT_S):
            raise TimeoutError(f"the peer process did not answer {name}{args}")
        return self._conn.recv()

    def __getattr__(self, name: str):
        return lambda *args: self.call(name, *args)

    def __len__(self) -> int:
        return self.call("__len__")

    def crash(self) -> None:
        self._conn.send(("crash", ()))
        self.process.join(PEER_TIMEOUT_S)

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.send(None)
        self.process.join(PEER_TIMEOUT_S)


def _start(now: list[float], lease_s: float = LEASE_S) -> SessionService:
    return start_session_service(max_sessions=2, ttl_s=10.0, lease_s=lease_s, clock=lambda: now[0])


@pytest.fixture
def now() -> list[float]:
    """The service's clock, in seconds."""
    return [0.0]


@pytest.fixture
def service(now):
    service = _start(now)
    yield service
    service.shutdown()


@pytest.fixture
def local(service):
    store = RemoteSessionStore(service.address)
    yield store
    store.close()


@pytest.fixture
def peer(service):
    peer = _Peer(service.address)
    yield peer
    peer.close()


# ---- the store ------------------------------------------------------------------------------------------------
def _lru_and_ttl(a, b, now: list[float]) -> None:
    """The LRU and TTL oracle of test_server_units (max_sessions=2, ttl 10 s), with its calls
    alternating between stores a and b."""
    a.save("p", "a", "m", [{"role": "user", "content": "1"}])
    b.save("p", "b", "m", [])
    assert b.get("p", "a") is not None  # reading does not count as use
    a.save("p", "c", "m", [])  # evicts the least recently saved: a
    assert [s.id for s in b.list("p")] == ["c", "b"] and a.get("p", "a") is None
    now[0] = 5.0
    b.save("p", "b", "m", [{"role": "user", "content": "2"}])
    now[0] = 12.0  # c idle for 12 s > ttl; b for 7 s
    assert a.get("p", "c") is None and b.get("p", "b").messages == [{"role": "user", "content": "2"}]
    assert a.delete("p", "b") and not b.delete("p", "b") and len(a) == 0 and len(b) == 0


def test_lru_and_ttl_oracle_on_one_process_store(now):
    store = SessionStore(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    _lru_and_ttl(store, store, now)


def test_lru_and_ttl_across_processes(local, peer, now):
    _lru_and_ttl(local, peer, now)


def test_session_is_shared_across_processes_and_owners_stay_apart(local, peer):
    made = local.create("alice", "m")
    assert len(made.id) == 32 and int(made.id, 16) >= 0
    seen = peer.get("alice", made.id)
    assert (seen.id, seen.model, seen.messages) == (made.id, "m", [])
    peer.save("alice", made.id, "m", [{"role": "user", "content": "hi"}])
    copy = local.get("alice", made.id)
    assert copy.messages == [{"role": "user", "content": "hi"}]
    copy.messages.append({"role": "user", "content": "not saved"})  # a copy: the store is unchanged
    assert peer.get("alice", made.id).messages == [{"role": "user", "content": "hi"}]

    assert peer.get("bob", made.id) is None and local.list("bob") == [] and not peer.delete("bob", made.id)
    peer.save("bob", made.id, "m", [])  # the same id in another namespace
    for i in range(5):  # bob overflows his own quota only
        local.save("bob", f"s{i}", "m", [])
    assert len(peer.list("bob")) == 2 and local.get("alice", made.id).messages[0]["content"] == "hi"
    assert peer.delete("alice", made.id) and local.get("alice", made.id) is None and len(local) == 2


def test_limits_are_checked_before_serving():
    with pytest.raises(ValueError, match="max_sessions"):
        start_session_service(max_sessions=0, ttl_s=10.0)
    with pytest.raises(ValueError, match="lease"):
        start_session_service(max_sessions=1, ttl_s=10.0, lease_s=0)


# ---- turns ----------------------------------------------------------------------------------------------------
def test_turns_of_one_session_are_serialized_across_processes(local, peer):
    first_turn = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "one"}]

    async def second_turn() -> None:
        assert peer.call("acquire", "alice", "s")  # the first turn runs in the peer process
        lock = local.lock("alice", "s")
        waiting = asyncio.create_task(lock.acquire())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert peer.call("acquire", "bob", "s")  # another owner's session of the same id is not held
        peer.save("alice", "s", "m", first_turn)
        peer.call("release", "alice", "s")
        await asyncio.wait_for(waiting, PEER_TIMEOUT_S)
        try:
            assert local.get("alice", "s").messages == first_turn  # the second turn sees the first's reply
        finally:
            lock.release()
        assert peer.call("acquire", "alice", "s")

    asyncio.run(second_turn())


def test_turns_within_one_process_queue_on_its_own_lock(local):
    async def turns() -> None:
        first, second = local.lock("alice", "s"), local.lock("alice", "s")
        await first.acquire()
        waiting = asyncio.create_task(second.acquire())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        first.release()
        await asyncio.wait_for(waiting, PEER_TIMEOUT_S)
        second.release()

    asyncio.run(turns())


def test_lease_of_a_crashed_holder_expires(local, peer, now):
    assert peer.call("acquire", "alice", "s")
    peer.crash()

    async def next_turn() -> None:
        lock = local.lock("alice", "s")
        with pytest.raises(TimeoutError):  # the dead holder's lease still runs
            await asyncio.wait_for(lock.acquire(), 0.2)
        now[0] += LEASE_S
        await asyncio.wait_for(lock.acquire(), PEER_TIMEOUT_S)  # so the cancelled wait left nothing held
        lock.release()

    asyncio.run(next_turn())


def test_holder_renews_its_lease_while_it_holds_it(now):
    service = _start(now, lease_s=0.3)  # renewed every 0.1 s of real time
    holder_store, other_store = RemoteSessionStore(service.address), RemoteSessionStore(service.address)
    calls: list[str] = []

    def spy(name: str, *args):  # counts the holder's round trips (through the store's private call)
        calls.append(name)
        return holder_store._call(name, *args)

    async def long_turn() -> None:
        holder = SharedSessionLock(spy, asyncio.Lock(), "alice", "s")
        await holder.acquire()  # its lease runs to 0.3 on the service's clock
        now[0] = 0.2
        while calls.count("try_acquire") < 2:  # until it renewed, to 0.5
            await asyncio.sleep(0.01)
        now[0] = 0.4  # past the first lease, within the renewed one
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(other_store.lock("alice", "s").acquire(), 0.2)
        holder.release()

    try:
        asyncio.run(long_turn())
    finally:
        holder_store.close()
        other_store.close()
        service.shutdown()


# ---- failures -------------------------------------------------------------------------------------------------
def test_service_answers_a_bad_call_and_keeps_serving(service, local):
    with zmq.Context() as context, context.socket(zmq.REQ) as raw:
        raw.connect(service.address)
        raw.send(b"not msgpack \xc1")
        assert "error" in msgspec.msgpack.decode(raw.recv())
        raw.send(msgspec.msgpack.encode({"call": "shutdown", "args": []}))
        assert "unknown call" in msgspec.msgpack.decode(raw.recv())["error"]
    assert local.create("alice", "m").model == "m"


def test_calls_fail_soon_after_the_service_stops(now):
    service = _start(now)
    store = RemoteSessionStore(service.address, timeout_s=0.5)
    try:
        store.create("alice", "m")
        service.shutdown()
        assert not Path(service.address.removeprefix("ipc://")).parent.exists()
        started = time.monotonic()
        with pytest.raises(SessionServiceError, match="'create'"):
            store.create("alice", "m")
        with pytest.raises(SessionServiceError, match="'try_acquire'"):  # and the lock's wait does not hang
            asyncio.run(store.lock("alice", "s").acquire())
        assert time.monotonic() - started < 10.0
    finally:
        store.close()
