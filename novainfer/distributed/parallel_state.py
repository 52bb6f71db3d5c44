"""Which tensor-parallel group the model being built belongs to.

Layers read the current group once, when they are constructed, and keep it. The group is
thread-local so that one process can build several ranks' models on several threads (the
single-process ``uni`` executor) without them seeing each other's group.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from novainfer.distributed.process_group import ProcessGroup, SingleRankProcessGroup

_state = threading.local()
_SINGLE = SingleRankProcessGroup("tp-single")


def get_tp_group() -> ProcessGroup:
    """The tensor-parallel group of the model being built on this thread (a single rank by default)."""
    return getattr(_state, "tp_group", _SINGLE)


def single_rank_group() -> ProcessGroup:
    """A group of one rank, for layers that are replicated rather than sharded."""
    return _SINGLE


@contextlib.contextmanager
def tp_group_context(group: ProcessGroup) -> Iterator[ProcessGroup]:
    """Builds layers under ``group``: inside the block, ``get_tp_group()`` returns it."""
    previous = getattr(_state, "tp_group", None)
    _state.tp_group = group
    try:
        yield group
    finally:
        if previous is None:
            del _state.tp_group
        else:
            _state.tp_group = previous
