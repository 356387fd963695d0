"""A producer of header names that are not UTF-8, as a foreign client may send them (Kafka's
header names are strings; aiokafka and confluent-kafka encode every name as UTF-8, the
latter turning bytes into their repr). aiokafka's pure-Python batch builder writes
``name.encode("utf-8")``: a name whose ``encode`` gives other bytes is sent as those.
Test-only, and in this process only while :func:`produce_raw_names` runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import aiokafka.producer.message_accumulator as accumulator
import aiokafka.producer.producer as producer_module
from aiokafka import AIOKafkaProducer
from aiokafka.record import default_records


class RawName(str):
    """A header name sent as ``raw`` (any bytes), shown as their escaped text."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawName:
        name = super().__new__(cls, raw.decode("utf-8", "backslashreplace"))
        name.raw = raw
        return name

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


@contextlib.contextmanager
def raw_name_builders() -> Iterator[None]:
    """While it lasts, aiokafka producers of this process send :class:`RawName` header
    names as their bytes (its pure-Python batch builder, slower, the same format)."""
    # Where aiokafka's producer sizes (producer, 0.13 and later) and builds (accumulator)
    # its batches.
    modules = [m for m in (accumulator, producer_module) if hasattr(m, "DefaultRecordBatchBuilder")]
    builders: list[Any] = [m.DefaultRecordBatchBuilder for m in modules]
    for module in modules:
        module.DefaultRecordBatchBuilder = default_records._DefaultRecordBatchBuilderPy
    try:
        yield
    finally:
        for module, builder in zip(modules, builders, strict=True):
            module.DefaultRecordBatchBuilder = builder


async def produce_raw_names(
    bootstrap: str,
    topic: str,
    records: Sequence[tuple[bytes | None, bytes | None, Sequence[tuple[str, bytes]]]],
    partition: int = 0,
) -> None:
    """Produce ``records`` (key, value, headers) in order, in batches as a producer
    lingering 5 ms makes them, header names given as :class:`RawName` sent as their bytes."""
    with raw_name_builders():
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            futures = [
                await producer.send(
                    topic, value, key=key, headers=list(headers), partition=partition
                )
                for key, value, headers in records
            ]
            for future in futures:
                await future
        finally:
            await producer.stop()
