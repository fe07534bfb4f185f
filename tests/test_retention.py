"""The engines take KV-cache retention hints as TensorRT-LLM's backend does: they change nothing here, but what the
backend refuses (utils.cc getKvCacheRetentionConfigFromTensors, KvCacheRetentionConfig's constructor) is refused,
naming the input, never served."""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.contract import tensors_to_request
from trtspec.errors import RequestError

BASE = {
    "input_ids": np.array([[5, 9, 23, 7]], dtype=np.int32),
    "input_lengths": np.array([[4]], dtype=np.int32),
    "request_output_len": np.array([[4]], dtype=np.int32),
}


def _hints(**columns) -> dict:
    return BASE | {f"retention_token_range_{k}": np.array([v], dtype=np.int32) for k, v in columns.items()}


@pytest.mark.parametrize(
    "columns",
    [
        {"starts": [0], "ends": [-1], "priorities": [80]},
        {"starts": [0, 90], "ends": [64, 128], "priorities": [100, 0], "durations_ms": [-1, 500]},
        {"starts": [50, 30], "ends": [100, 40], "priorities": [10, 20]},
        {"starts": [0, 30, 60], "ends": [30, 50, 80], "priorities": [1, 2, 3]},
    ],
)
def test_hints_the_backend_takes_are_served(columns):
    assert tensors_to_request(_hints(**columns)).input_ids == [5, 9, 23, 7]


@pytest.mark.parametrize(
    ("columns", "named", "words"),
    [
        ({"starts": [0], "priorities": [80]}, "ends", "must be provided"),
        ({"starts": [0, 4], "ends": [4], "priorities": [80, 80]}, "ends", "same length"),
        ({"starts": [0], "ends": [4]}, "priorities", "must be provided"),
        ({"starts": [0], "ends": [4], "priorities": [80], "durations_ms": [1, 2]}, "durations_ms", "same length"),
        ({"starts": [0], "ends": [4], "priorities": [101]}, "priorities", "[0, 100]"),
        ({"starts": [0, 30], "ends": [-1, 50], "priorities": [1, 1]}, "ends", "only the last range"),
        ({"starts": [-1], "ends": [4], "priorities": [1]}, "starts", "non-negative"),
        ({"starts": [4], "ends": [4], "priorities": [1]}, "ends", "non-zero length"),
        ({"starts": [0, 60], "ends": [64, 80], "priorities": [1, 1]}, "starts", "non-overlapping"),
    ],
)
def test_hints_the_backend_refuses_are_refused_naming_the_input(columns, named, words):
    with pytest.raises(RequestError) as refused:
        tensors_to_request(_hints(**columns))
    assert f"retention_token_range_{named}" in str(refused.value) and words in str(refused.value)


def test_a_decode_priority_out_of_range_is_refused():
    for tensors in (_hints(starts=[0], ends=[4], priorities=[1]), BASE):
        with pytest.raises(RequestError, match=r"retention_decode_priority.*\[0, 100\]"):
            tensors_to_request(tensors | {"retention_decode_priority": np.array([[200]])})
