"""A Kafka record as aiokafka hands it over, for unit tests of decoding (no broker)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rec:
    topic: str = "t"
    partition: int = 2
    offset: int = 7
    key: bytes | None = b"k"
    value: bytes | None = b"{}"
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp: int = 1_700_000_000_000
