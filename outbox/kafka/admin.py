"""Reading the admin client's answers: aiokafka returns per-topic error codes in them
instead of raising."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiokafka import errors as kerr
from aiokafka.errors import KafkaError

UNKNOWN_TOPIC = 3  # the error code of a DescribeTopics answer for a topic that is not there


def partition_counts(described: Iterable[Any], names: Iterable[str]) -> dict[str, int | None]:
    """Partition count of each topic of a DescribeTopics answer; None when it is missing."""
    found: dict[str, int | None] = dict.fromkeys(names)
    for t in described:
        if t["error_code"] != UNKNOWN_TOPIC and t["partitions"]:
            found[t["topic"]] = len(t["partitions"])
    return found


def topic_error(response: Any, name: str) -> KafkaError | None:
    """The error a CreateTopics answer gives for ``name`` (aiokafka returns per-topic error
    codes instead of raising), or None."""
    for entry in response.topic_errors:
        topic, code = entry[0], entry[1]
        if topic == name and code != 0:
            message = entry[2] if len(entry) > 2 else None
            error: KafkaError = kerr.for_code(code)(message) if message else kerr.for_code(code)()
            return error
    return None
