"""A llama.cpp-style low-level model interface: batches of tokens in, logits out, KV cells managed
by the caller (see the README's "Low-level model interface").

    model = Model.from_pretrained(path, n_ctx=4096)
    batch = Batch.init(512, n_seq_max=1)
    for i, t in enumerate(prompt):
        batch.add(t, i, [0], logits=i == len(prompt) - 1)
    assert model.decode(batch) == 0, model.last_error
    next_token = int(model.get_logits_ith(-1).argmax())
"""

from novainfer.core_api.batch import Batch
from novainfer.core_api.kv_cells import CellInfo, KvStatus
from novainfer.core_api.model import (DECODE_ABORTED, DECODE_FATAL, DECODE_INVALID, DECODE_NO_KV_SLOT, DECODE_OK,
                                      Model)
from novainfer.core_api.sampling import sample_token

__all__ = ["DECODE_ABORTED", "DECODE_FATAL", "DECODE_INVALID", "DECODE_NO_KV_SLOT", "DECODE_OK", "Batch",
           "CellInfo", "KvStatus", "Model", "sample_token"]
