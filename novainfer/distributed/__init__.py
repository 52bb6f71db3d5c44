from novainfer.distributed.factory import ProcessGroupFactory
from novainfer.distributed.parallel_state import (
    get_tp_group,
    get_vocab_parallel_group,
    init_tensor_parallel_group,
    single_rank_group,
    tp_group_context,
)
from novainfer.distributed.process_group import (
    CollectiveAbortedError,
    ProcessGroup,
    ReduceOpType,
    SingleRankProcessGroup,
)
from novainfer.distributed.work import CompletedWork, Work

__all__ = [
    "CollectiveAbortedError",
    "CompletedWork",
    "ProcessGroup",
    "ProcessGroupFactory",
    "ReduceOpType",
    "SingleRankProcessGroup",
    "Work",
    "get_tp_group",
    "get_vocab_parallel_group",
    "init_tensor_parallel_group",
    "single_rank_group",
    "tp_group_context",
]
