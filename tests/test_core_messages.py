"""The per-step message of the engine core: per-request outputs laid out as columns, through the wire."""

from __future__ import annotations

import pytest

from novainfer.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreStats
from novainfer.engine.serial import StepOutputs, core_message_decoder, core_message_encoder
from novainfer.outputs import StepLogprobs


def _rows(message: EngineCoreOutputs) -> list[EngineCoreOutput]:
    """The per-request outputs back from the columns, read as the message's docstring lays them out."""
    finished = {i: (r, s) for i, r, s in zip(message.finished, message.finish_reasons, message.stop_reasons)}
    started = {i: (n, t) for i, n, t in zip(message.started, message.num_cached_tokens,
                                             message.first_scheduled_times)}
    logprobs = {i: (message.logprobs_blocks[b], row)
                for i, b, row in zip(message.with_logprobs, message.logprobs_block_index, message.logprobs_rows)}
    rows, offset = [], 0
    for i, (request_id, num) in enumerate(zip(message.request_ids, message.num_new_tokens)):
        reason, stop = finished.get(i, (None, None))
        cached, first_time = started.get(i, (-1, None))
        rows.append(EngineCoreOutput(request_id, message.token_ids[offset:offset + num], logprobs.get(i), reason, stop,
                                     cached, first_time))
        offset += num
    assert offset == len(message.token_ids)
    return rows


def _through_wire(message: EngineCoreOutputs) -> EngineCoreOutputs:
    return core_message_decoder.decode(core_message_encoder.encode(StepOutputs(message))).outputs


# Logprob rows of two steps (width 2: the sampled token, then the top alternative).
STEP = StepLogprobs.of(2, [33, 4, 31, 4, 32, 31], [-0.1, -2.0, -0.5, -1.5, -0.25, -0.7], [1, 2, 1])
OTHER_STEP = StepLogprobs.of(2, [34, 34], [-0.3, -0.3], [1])


MIXED_STEP = [
    EngineCoreOutput("decoding", [11]),
    EngineCoreOutput("first", [12], num_cached_tokens=16, first_scheduled_time=5.5),
    EngineCoreOutput("speculative", [13, 14, 15]),
    EngineCoreOutput("eos", [2], finish_reason="stop"),
    EngineCoreOutput("stop-id", [7, 9], finish_reason="stop", stop_reason=9),
    EngineCoreOutput("length", [21], finish_reason="length", num_cached_tokens=0, first_scheduled_time=6.0),
    EngineCoreOutput("logprobs", [31, 32], new_logprobs=(STEP, 1)),
    EngineCoreOutput("logprobs-too", [33], new_logprobs=(STEP, 0)),
    EngineCoreOutput("joined-steps", [34], new_logprobs=(OTHER_STEP, 0)),
    EngineCoreOutput("aborted-empty", [], finish_reason="abort"),
]


def test_a_mixed_step_survives_the_columns_and_the_wire():
    outputs = MIXED_STEP
    stats = EngineCoreStats(num_running_reqs=3, num_steps=7)
    columns = EngineCoreOutputs.from_outputs(outputs, stats, 123.5)
    assert columns.logprobs_blocks == [STEP, OTHER_STEP]  # each block once, however many requests use it
    message = _through_wire(columns)
    assert _rows(message) == outputs
    assert message.stats == stats and message.timestamp == 123.5


def test_an_empty_step_is_an_empty_message():
    message = _through_wire(EngineCoreOutputs.from_outputs([], None, 1.0))
    assert _rows(message) == [] and message.stats is None and message.timestamp == 1.0


@pytest.mark.parametrize("keep", [[], [0], [2, 3, 8], [6, 7], [1, 4, 5, 9], list(range(len(MIXED_STEP)))])
def test_a_subset_of_a_step_is_the_message_of_those_requests_alone(keep):
    """What one of several front-ends gets: the same as columns built from its requests' outputs."""
    stats = EngineCoreStats(num_running_reqs=3)
    subset = _through_wire(EngineCoreOutputs.from_outputs(MIXED_STEP, stats, 2.0).subset(keep))
    assert _rows(subset) == [MIXED_STEP[i] for i in keep]
    assert subset.logprobs_blocks == EngineCoreOutputs.from_outputs([MIXED_STEP[i] for i in keep], None,
                                                                    0.0).logprobs_blocks
    assert subset.stats == stats and subset.timestamp == 2.0


@pytest.mark.parametrize("keep", [[0], [1], [0, 1, 2]])
def test_a_subset_keeps_each_requests_tokens_when_their_count_equals_the_requests(keep):
    """As many tokens as requests without one each (an aborted request beside an accepted draft)."""
    step = [EngineCoreOutput("aborted", [], finish_reason="abort"), EngineCoreOutput("accepted", [5, 6]),
            EngineCoreOutput("decoding", [7])]
    subset = _through_wire(EngineCoreOutputs.from_outputs(step, None, 1.0).subset(keep))
    assert _rows(subset) == [step[i] for i in keep]
