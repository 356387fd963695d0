"""Part of the aiokafka room (outbox/kafka/aiokafka_internals.py, its capability
``undecodable header names``): reading a fetch whose record has a header name that is not
UTF-8. Only that module imports this one.

Kafka's header names are strings, but a foreign producer can send any bytes, and aiokafka
decodes them strictly while it unpacks a fetch (its compiled parser and the pure-Python
one alike): one such record raises UnicodeDecodeError out of every getmany() for its
partition, and the partition never moves. The fetcher builds each fetch's records through
the module name ``MemoryRecords``; the room puts a wrapper there that hands aiokafka's own
(compiled) batches through unchanged and, only when one of them fails to decode a header
name, reads the rest of that batch again with aiokafka's pure-Python reader, whose
``_read_msg`` is repeated here with one difference: a name that is not UTF-8 comes out as
an :class:`~outbox.kafka.client.UndecodedHeader` (its bytes escaped) and the inbox
dead-letters the record. The start check reads such a record back (:func:`read_back`).
"""

from __future__ import annotations

import functools
import importlib
import struct
from collections.abc import Callable, Iterator
from typing import Any

from outbox.kafka.client import UndecodedHeader


def _module(name: str) -> Any:
    return importlib.import_module(name)


class LenientRecords:
    """aiokafka's ``MemoryRecords`` of one fetch, each batch wrapped in :class:`_Batch`.
    The room installs a subclass whose :meth:`lost` marks its capability lost."""

    __slots__ = ("_data", "_records")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._records = _module("aiokafka.record.memory_records").MemoryRecords(data)

    @staticmethod
    def lost(exc: BaseException) -> None:
        """The lenient reader failed on this aiokafka (``exc``)."""

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        batch = self._records.next_batch()
        return None if batch is None else _Batch(batch, self._data, self.lost)


class _Batch:
    """One of aiokafka's record batches, the same but for a header name it cannot decode."""

    __slots__ = ("_batch", "_data", "_lost")

    def __init__(self, batch: Any, data: bytes, lost: Callable[[BaseException], None]) -> None:
        self._batch = batch
        self._data = data
        self._lost = lost

    def __getattr__(self, name: str) -> Any:  # base_offset, validate_crc, ...
        return getattr(self._batch, name)

    def __next__(self) -> Any:  # the fetcher reads a control batch's marker so
        return next(self._batch)

    def __iter__(self) -> Iterator[Any]:
        return self._records()

    def _records(self) -> Iterator[Any]:
        done = -1  # the offset of the last record handed out
        try:
            for record in self._batch:
                done = record.offset
                yield record
            return
        except UnicodeDecodeError as exc:
            failed: BaseException = exc
        # Not in the except block: the records read again are handed out from here.
        try:
            lenient = _lenient_batch(self._data, self._batch.base_offset)
        except (AttributeError, LookupError, TypeError) as exc:
            self._lost(exc)
            raise failed from None
        for record in lenient:
            if record.offset > done:
                yield record


def _lenient_batch(data: bytes, base_offset: int) -> Any:
    """The batch of ``data`` (one fetch's records) starting at ``base_offset``, read by
    the lenient pure-Python reader (only on this rare path: it is slow)."""
    pos = 0
    while pos + 17 <= len(data):  # base offset (8), length (4), epoch (4), magic (1)
        offset, length = struct.unpack_from(">qi", data, pos)
        end = pos + 12 + length
        if offset == base_offset and data[pos + 16] >= 2:
            return _lenient_class()(memoryview(data)[pos:end])
        pos = end
    raise LookupError(f"no record batch at offset {base_offset} in the fetch")


@functools.cache
def _lenient_class() -> type:
    records = _module("aiokafka.record.default_records")
    from aiokafka.errors import CorruptRecordException
    from aiokafka.record.util import decode_varint

    record_class = records._DefaultRecordPy

    class LenientBatch(records._DefaultRecordBatchPy):  # type: ignore[misc,name-defined]
        _pos: int  # where the next record starts in the (decompressed) buffer

        def _read_msg(self, decode_varint: Callable[..., tuple[int, int]] = decode_varint) -> Any:
            # aiokafka's own (0.12 to 0.14 alike), but for the header names.
            buffer = self._buffer
            pos = self._pos
            length, pos = decode_varint(buffer, pos)
            start_pos = pos
            _, pos = decode_varint(buffer, pos)  # attributes, unused
            ts_delta, pos = decode_varint(buffer, pos)
            if self.timestamp_type == self.LOG_APPEND_TIME:
                timestamp = self.max_timestamp
            else:
                timestamp = self.first_timestamp + ts_delta
            offset_delta, pos = decode_varint(buffer, pos)
            key_len, pos = decode_varint(buffer, pos)
            key = None if key_len < 0 else bytes(buffer[pos : pos + key_len])
            pos += max(key_len, 0)
            value_len, pos = decode_varint(buffer, pos)
            value = None if value_len < 0 else bytes(buffer[pos : pos + value_len])
            pos += max(value_len, 0)
            header_count, pos = decode_varint(buffer, pos)
            if header_count < 0:
                raise CorruptRecordException(
                    f"Found invalid number of record headers {header_count}"
                )
            headers: list[tuple[str, bytes | None]] = []
            for _ in range(header_count):
                name_len, pos = decode_varint(buffer, pos)
                if name_len < 0:
                    raise CorruptRecordException(f"Invalid negative header key size {name_len}")
                raw_name = bytes(buffer[pos : pos + name_len])
                pos += name_len
                h_value_len, pos = decode_varint(buffer, pos)
                h_value = None if h_value_len < 0 else bytes(buffer[pos : pos + h_value_len])
                pos += max(h_value_len, 0)
                try:
                    headers.append((raw_name.decode("utf-8"), h_value))
                except UnicodeDecodeError:
                    escaped = raw_name.decode("utf-8", "backslashreplace")
                    headers.append(UndecodedHeader((escaped, h_value)))
            if pos - start_pos != length:
                raise CorruptRecordException(
                    f"Invalid record size: expected to read {length} bytes in record "
                    f"payload, but instead read {pos - start_pos}"
                )
            self._pos = pos
            return record_class(
                self.base_offset + offset_delta,
                timestamp,
                self.timestamp_type,
                key,
                value,
                headers,
            )

    return LenientBatch


def read_back() -> str | None:
    """None when :class:`LenientRecords` reads a batch of two records, the first with a
    header name that is not UTF-8, as it should (what the fetcher sees), else what it read."""
    records = _module("aiokafka.record.default_records")
    builder = records.DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 16,
    )
    builder.append(0, timestamp=1, key=b"k", value=b"v", headers=[("Z~", b"h"), ("a", None)])
    builder.append(1, timestamp=2, key=None, value=b"w", headers=[("ok", b"h")])
    data = bytes(builder.build())
    name = data.rindex(b"Z~")
    data = data[:name] + b"\xff" + data[name + 1 :]  # the name's first byte: not UTF-8
    read = LenientRecords(data).next_batch()
    got = [(r.offset, r.key, r.value, [(type(h), *h) for h in r.headers]) for r in read]
    want = [
        (0, b"k", b"v", [(UndecodedHeader, "\\xff~", b"h"), (tuple, "a", None)]),
        (1, None, b"w", [(tuple, "ok", b"h")]),
    ]
    return None if got == want else f"a record with a header name not UTF-8 read as {got!r:.200}"
