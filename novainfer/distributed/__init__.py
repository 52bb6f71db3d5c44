from novainfer.distributed.parallel_state import get_tp_group, single_rank_group, tp_group_context
from novainfer.distributed.process_group import (
    CompletedWork,
    ProcessGroup,
    ReduceOpType,
    SingleRankProcessGroup,
    Work,
)

__all__ = [
    "CompletedWork",
    "ProcessGroup",
    "ReduceOpType",
    "SingleRankProcessGroup",
    "Work",
    "get_tp_group",
    "single_rank_group",
    "tp_group_context",
]
