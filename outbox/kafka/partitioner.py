"""Kafka's default partitioner for keyed records (murmur2 of the key): the partition any
Kafka client puts a key in, whichever client library sends it."""

from __future__ import annotations

from aiokafka.partitioner import murmur2


def key_partition(parts: list[int], key: bytes) -> int:
    """The partition of ``parts`` a keyed record goes to."""
    return parts[int(murmur2(key) & 0x7FFFFFFF) % len(parts)]
