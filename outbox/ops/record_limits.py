"""How large a record a topic takes, and what a dead-letter topic needs to take every
record of its source topic.

A dead letter is the source record plus ``dlq_*`` headers (error class and message,
attempts, consumer, origin), so its topic must accept the source's ``max.message.bytes``
plus room for those headers. A dead-letter topic created with the broker's defaults
(``message.max.bytes``, 1 MB) refuses the large records of a topic that allows more, at
the very moment they most need a place to go. Topics the framework creates therefore copy
the source's limit (plus :func:`header_room`) and its ``compression.type``; ``doctor``
reports an existing dead-letter topic that accepts less than its source.

Only the leader broker's view matters for a produce: ``replica.fetch.max.bytes`` does not
bound record sizes (followers fetch an oversized first batch whole, KIP-74).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, for_code

MAX_MESSAGE_BYTES = "max.message.bytes"
COMPRESSION = "compression.type"
# Fixed part of the room a dead letter's headers need: class name, attempts, consumer,
# original topic (at most 249 characters), partition, offset, and the record overhead.
_FIXED_HEADER_ROOM = 16 * 1024


@dataclass(frozen=True)
class TopicLimits:
    """A topic's effective ``max.message.bytes`` and ``compression.type`` (its own
    setting, or the broker's default it inherits)."""

    max_message_bytes: int
    compression: str


def header_room(error_message_chars: int) -> int:
    """Bytes the ``dlq_*`` headers may add to a record: the error message is cut to
    ``error_message_chars`` characters (up to 4 bytes each in UTF-8), the rest is small."""
    return _FIXED_HEADER_ROOM + 4 * error_message_chars


def dead_letter_configs(source: TopicLimits, error_message_chars: int) -> dict[str, str]:
    """Topic configs for a dead-letter topic of ``source``."""
    return {
        MAX_MESSAGE_BYTES: str(source.max_message_bytes + header_room(error_message_chars)),
        COMPRESSION: source.compression,
    }


async def describe_limits(
    admin: AIOKafkaAdminClient, topics: Iterable[str]
) -> tuple[dict[str, TopicLimits], dict[str, KafkaError]]:
    """The limits of each topic Kafka describes, and the error of each it does not (an
    unknown topic, or no DESCRIBE_CONFIGS permission). Raises KafkaError when the request
    itself fails."""
    names = sorted(set(topics))
    if not names:
        return {}, {}
    wanted = {MAX_MESSAGE_BYTES: None, COMPRESSION: None}
    responses = await admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, name, wanted) for name in names]
    )
    found: dict[str, TopicLimits] = {}
    failed: dict[str, KafkaError] = {}
    for response in responses:
        for code, message, _type, name, entries, *_ in response.resources:
            if code:
                error: KafkaError = for_code(code)(message) if message else for_code(code)()
                failed[name] = error
                continue
            values = {entry[0]: entry[1] for entry in entries}
            try:
                found[name] = TopicLimits(
                    int(values[MAX_MESSAGE_BYTES]), values.get(COMPRESSION) or "producer"
                )
            except (KeyError, TypeError, ValueError):
                failed[name] = KafkaError(f"no {MAX_MESSAGE_BYTES} in Kafka's answer")
    return found, failed
