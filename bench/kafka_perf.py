"""The limit beside the relay: Kafka's own producer (``ProducerPerformance`` from the
kafka-tools jar, fetched and cached by ``scripts/services kafka-tools``) sending as fast as
it can into the same broker, in the same run, to a fresh topic with the same partitions.

Its records are of the payload's size (300 B), with no key and no headers, so each
carries less than a relay's record (a key and the CloudEvents headers, ~150 B more): the
fraction printed is conservative for the relay. Its producer is the Java client with the
relay's durability (``acks=all``, idempotence) and the relay's largest batch
(``batch.size`` = ``relay.max_batch_bytes``, 512 KiB; Kafka's default 16 KiB gave 0.4-0.7x
of it here), ``linger.ms`` 5. It sends five times the relay's backlog (1,000,000 records
for the default 200,000): its clock runs from its first send, JVM warm-up included, and
with the backlog's count alone that warm-up was half of its run (264k records/s against
483k for a million, same settings, same broker, one after the other).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

from bench.common import create_topic
from outbox.settings import OutboxSettings

ROOT = Path(__file__).resolve().parent.parent
RECORD_SIZE = 300
RECORDS_PER_EVENT = 5  # records sent per event of the relay's backlog (see above)
_SUMMARY = re.compile(r"(\d+) records sent, ([\d.]+) records/sec")


def tools_classpath() -> str:
    """The tools' jars (fetched once into .cache/kafka/tools), as a java classpath."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "services"), "kafka-tools"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"fetching Kafka's tools failed: {done.stderr.strip()[-500:]}")
    return f"{done.stdout.strip().splitlines()[-1]}/*"


def producer_performance(
    settings: OutboxSettings, partitions: int, events: int, classpath: str
) -> float:
    """Records/s of Kafka's own producer into a fresh topic of ``partitions``, sending
    ``RECORDS_PER_EVENT`` records per event of the relay's backlog of ``events``."""
    records = events * RECORDS_PER_EVENT
    if settings.kafka.security_protocol != "PLAINTEXT":
        raise SystemExit("the Kafka baseline runs over a PLAINTEXT listener only")
    topic = asyncio.run(create_topic(settings, partitions))
    done = subprocess.run(
        [
            "java",
            "-cp",
            classpath,
            "org.apache.kafka.tools.ProducerPerformance",
            "--topic",
            topic,
            "--num-records",
            str(records),
            "--record-size",
            str(RECORD_SIZE),
            "--throughput",
            "-1",
            "--producer-props",
            f"bootstrap.servers={settings.kafka_bootstrap_servers}",
            "acks=all",
            "enable.idempotence=true",
            f"batch.size={settings.relay.max_batch_bytes}",
            "linger.ms=5",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    # The last summary line is the whole run's (the others are 5-second windows).
    found = _SUMMARY.findall(done.stdout)
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip()[-800:]
        raise SystemExit(f"ProducerPerformance failed (exit {done.returncode}): {tail}")
    sent, rate = found[-1]
    if int(sent) != records:
        raise SystemExit(f"ProducerPerformance sent {sent} of {records} records")
    return float(rate)
