"""The relay's view of the brokers: which answer now, and which to keep away from.

New clients (a replacement producer, the leader watch's client) and the broker asked for a
producer id are chosen from it. aiokafka shuffles a bootstrap list and picks a broker at
random for a producer id; a hung broker among them holds a start for a whole request
timeout (measured: the hung-broker test's partitions waited for the broker's return). So
brokers known to answer — acknowledged a batch or answered the leader watch lately — come
first, and leaders of stalled partitions and brokers Kafka fenced come last.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from outbox.kafka.client import Producer
from relay.kafka.partitions import PartitionHealth

# A broker that acknowledged within this long is known to answer (a hung one stops at once).
ANSWERED_SECONDS = 3.0


class BrokerView:
    """Fed by the publisher (acknowledgements) and the leader watch (its answers and the
    brokers Kafka lists); read when a client starts or a broker is picked."""

    def __init__(
        self,
        configured: list[str],
        health: PartitionHealth,
        running: Callable[[], Producer | None],
    ) -> None:
        self._configured = configured  # the bootstrap brokers of the settings
        self._health = health
        self._running = running  # any running producer: its view of the cluster
        self.answered: dict[int, float] = {}  # broker -> loop time it last answered
        self.live: set[int] = set()  # brokers Kafka listed last (not fenced)

    def heard_from(self, node: int) -> None:
        self.answered[node] = asyncio.get_running_loop().time()

    def silent(self, node: int) -> None:
        """``node`` did not answer a question: no longer known to answer."""
        self.answered.pop(node, None)

    def answering(self) -> set[int]:
        """Brokers that acknowledged a batch, or answered the leader watch, within the last
        ``ANSWERED_SECONDS``: known to answer now. After a failover the hung broker's
        stalls are forgotten (its partitions have new leaders), so "sick" no longer names
        it; "answering" still leaves it out."""
        now = asyncio.get_running_loop().time()
        return {b for b, at in self.answered.items() if now - at < ANSWERED_SECONDS}

    def sick(self) -> set[int]:
        """Brokers to keep away from: leaders of stalled partitions, and brokers missing
        from the live ones the leader watch saw last (Kafka fenced them)."""
        sick = {leader for leader in self._health.leaders().values() if leader is not None}
        running = self._running()
        if running is not None and self.live:
            sick |= {b.node_id for b in running.brokers()} - self.live
        return sick

    def preferred(self, nodes: list[int]) -> tuple[list[int], bool]:
        """The brokers of ``nodes`` to ask first, and whether they are known to answer:
        those that answer now and lead no stalled partition; else those that answer (with
        ``acks=all`` a healthy leader's partitions stall too while they wait for a hung
        follower, and it still answers everything else: a hung broker answers nothing);
        else those not known to be sick. Empty when every one is sick."""
        sick, answering = self.sick(), self.answering()
        for choice in (
            [n for n in nodes if n in answering and n not in sick],
            [n for n in nodes if n in answering],
        ):
            if choice:
                return choice, True
        return [n for n in nodes if n not in sick], False

    def pick_node(self, nodes: list[int]) -> int | None:
        """Which of ``nodes`` to ask a question a client would send to a broker chosen at
        random (a new producer's id, the leader watch's metadata): one that hangs would hold
        it for a whole request timeout. Prefer the others."""
        if not nodes:
            return None
        return random.choice(self.preferred(nodes)[0] or nodes)

    def bootstrap(self) -> str:
        """Where a new client should connect first: the brokers a running producer knows
        to answer now (acknowledged lately, not leading a stalled partition), if any; else
        every broker it knows and the configured list."""
        running = self._running()
        if running is None:
            return ",".join(self._configured)
        brokers = running.brokers()
        best, answering = self.preferred([b.node_id for b in brokers])
        if best and (len(best) < len(brokers) or answering):
            # Not the configured list as well: it names the sick broker (a fenced one is
            # no longer among those Kafka lists), and a new producer that tried it first
            # waited for the hung broker's return.
            return ",".join(f"{b.host}:{b.port}" for b in brokers if b.node_id in best)
        return ",".join(dict.fromkeys([f"{b.host}:{b.port}" for b in brokers] + self._configured))
