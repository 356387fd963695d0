"""A multi-broker Kafka cluster of our own for the broker-failure tests.

``scripts/services cluster-*`` runs it (KRaft: nodes 1-3 are broker and controller, a fourth
is a broker only; replication factor 3, min.insync.replicas 2) in a state directory and on
ports of the test session's own, so that crashing, hanging or stopping a broker never
touches the shared single broker. The fixture starts it once per session, on first use;
every test leaves it with all brokers running and in sync.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests.support.kafka import ServicesFailed, free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PartitionInfo:
    partition: int
    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


@dataclass
class KafkaCluster:
    """Control of a cluster started by ``scripts/services cluster-up``; node N is broker N."""

    state: Path
    nodes: int = 4
    ports: list[int] = field(default_factory=list)
    controller_ports: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ports = self.ports or [free_port() for _ in range(self.nodes)]
        self.controller_ports = self.controller_ports or [free_port() for _ in range(3)]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def services(self, *args: str) -> str:
        env = {
            **os.environ,
            "OUTBOX_SERVICES_DIR": str(self.state),
            "OUTBOX_KAFKA_CLUSTER_PORTS": ",".join(map(str, self.ports)),
            "OUTBOX_KAFKA_CLUSTER_CONTROLLER_PORTS": ",".join(map(str, self.controller_ports)),
        }
        res = subprocess.run(
            [str(ROOT / "scripts" / "services"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        if res.returncode != 0:
            raise ServicesFailed(f"scripts/services {' '.join(args)} failed: {res.stderr[-2000:]}")
        return res.stdout

    # -- faults -----------------------------------------------------------------------------
    def kill(self, node: int) -> None:
        """SIGKILL: the broker crashes (no controlled shutdown)."""
        self.services("cluster-kill", str(node))

    def pause(self, node: int) -> None:
        """SIGSTOP: the broker hangs with its connections open (a GC pause, a stuck disk)."""
        self.services("cluster-pause", str(node))

    def resume(self, node: int) -> None:
        self.services("cluster-resume", str(node))

    def stop(self, node: int) -> None:
        """SIGTERM and wait: a controlled shutdown (leaderships are handed over first)."""
        self.services("cluster-stop", str(node))

    def start(self, node: int) -> None:
        self.services("cluster-start", str(node))

    def elect_preferred(self) -> None:
        """Every partition back to its preferred leader: after a fault the returning broker
        leads nothing until Kafka's imbalance check (every 5 minutes), so the next test's
        busiest leader would be another broker, one leading no offsets partition."""
        self.services("cluster-elect")

    def heal(self, node: int) -> None:
        """Resume a paused node, start a stopped one (a test's clean-up)."""
        status = self.services("cluster-status")
        if f"node {node}: paused" in status:
            self.resume(node)
        elif f"node {node}: stopped" in status:
            self.start(node)

    # -- metadata ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admin(self) -> AsyncIterator[AIOKafkaAdminClient]:
        """An admin client whose start and close cannot hang a test on a sick broker."""
        client = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=5000)
        try:
            # Inside the try: a start given up on leaves a client whose metadata task would
            # outlive the test (the event loop is the session's) and log its broker's absence.
            await asyncio.wait_for(client.start(), 30)
            yield client
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5)

    async def create_topic(
        self, name: str, partitions: int, configs: dict[str, str] | None = None
    ) -> None:
        """A topic with replication factor 3 (min.insync.replicas 2, the cluster's)."""
        async with self.admin() as admin:
            await admin.create_topics([NewTopic(name, partitions, 3, topic_configs=configs or {})])

    def active_controller(self, topic: str) -> int | None:
        """The KRaft controller that created ``topic`` (the active one then: only it logs
        the CreateTopics result); None if no node's log says."""
        line = f"CreateTopics result(s): CreatableTopic(name='{topic}'"
        for node in range(1, 4):
            log = self.state / "cluster" / f"node{node}" / "kafka.log"
            with contextlib.suppress(OSError):
                if line in log.read_text(errors="replace"):
                    return node
        return None

    async def group_on(self, broker: int, tries: int = 60) -> str | None:
        """A consumer group name whose group coordinator is ``broker`` (None if no name
        tried lands there)."""
        async with self.admin() as admin:
            for _ in range(tries):
                name = f"c-{uuid.uuid4().hex[:8]}"
                try:
                    if await admin.find_coordinator(name) == broker:
                        return name
                except Exception:  # the offsets topic being created: ask again
                    await asyncio.sleep(0.5)
        return None

    async def coordinators(self) -> set[int]:
        """The brokers leading a partition of the offsets topic (group coordinators). Kafka
        creates that topic on the first coordinator lookup: on a fresh cluster, ask once
        and wait for it."""
        async with self.admin() as admin:
            for _ in range(60):
                try:
                    await admin.find_coordinator(f"c-{uuid.uuid4().hex[:8]}")
                    break
                except Exception:  # the offsets topic being created: ask again
                    await asyncio.sleep(0.5)
        await self.wait_in_sync(["__consumer_offsets"])
        return {p.leader for p in (await self.describe("__consumer_offsets")).values()}

    async def coordinator(self, group: str) -> int:
        async with self.admin() as admin:
            return int(await admin.find_coordinator(group))

    async def describe(self, topic: str) -> dict[int, PartitionInfo]:
        async with self.admin() as admin:
            [described] = await admin.describe_topics([topic])
        return {
            p["partition"]: PartitionInfo(
                p["partition"], p["leader"], tuple(p["replicas"]), tuple(p["isr"])
            )
            for p in described["partitions"]
        }

    async def wait_in_sync(self, topics: list[str], timeout: float = 90.0) -> None:  # noqa: ASYNC109
        """Until every broker is registered and every partition of ``topics`` has a leader
        and all of its replicas in sync (a restarted broker has caught up)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: object = None
        while True:
            try:
                async with self.admin() as admin:
                    cluster = await admin.describe_cluster()
                    described = await admin.describe_topics(topics) if topics else []
                brokers = len(cluster["brokers"])
                lagging = [
                    (t["topic"], p["partition"])
                    for t in described
                    for p in t["partitions"]
                    if p["leader"] < 0 or len(p["isr"]) < len(p["replicas"])
                ]
                missing = [t["topic"] for t in described if not t["partitions"]]
                if brokers == self.nodes and not lagging and not missing:
                    return
                last = (brokers, lagging[:5], missing)
            except Exception as exc:  # a broker still starting: ask again
                last = exc
            if loop.time() > deadline:
                raise AssertionError(f"cluster not in sync after {timeout} s: {last!r}")
            await asyncio.sleep(0.5)


class FailoverWatch:
    """Polls the topic's metadata (4 times a second) while a fault runs and records, per
    partition, when Kafka could take writes there again without the sick brokers: a leader
    among the others and none of them left in the in-sync replicas (``acks=all`` waits for
    every one of those)."""

    def __init__(self, cluster: KafkaCluster, topic: str, sick: set[int]) -> None:
        self._cluster, self._topic, self._sick = cluster, topic, sick
        self.recovered: dict[int, float] = {}  # partition -> wall time
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FailoverWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=10)

    async def _run(self) -> None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self._cluster.bootstrap, request_timeout_ms=2000
        )
        try:
            await admin.start()  # cancelled during its start, it must be closed too
            while True:
                try:
                    [described] = await asyncio.wait_for(admin.describe_topics([self._topic]), 3)
                except Exception:  # a node down or hung: ask again
                    described = {"partitions": []}
                now = time.time()
                for p in described["partitions"]:
                    clean = p["leader"] >= 0 and p["leader"] not in self._sick
                    clean = clean and not self._sick & set(p["isr"])
                    if clean:
                        self.recovered.setdefault(p["partition"], now)
                await asyncio.sleep(0.25)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin.close(), 5)


def busiest_leader(partitions: dict[int, PartitionInfo]) -> int:
    """The broker leading the most partitions (lowest id on a tie)."""
    counts = collections.Counter(p.leader for p in partitions.values())
    return min(counts, key=lambda b: (-counts[b], b))


@pytest.fixture(scope="session", params=[3, 4], ids=["3 brokers", "4 brokers"])
def kafka_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KafkaCluster]:
    """A cluster of three nodes, then one of four (three controllers each), started on first
    use and stopped before the next. On three nodes with replication factor 3 every
    partition has a replica on every broker: none is clear of a sick one. On four some are,
    and must not notice the fault."""
    nodes = int(request.param)
    cluster = KafkaCluster(tmp_path_factory.mktemp("cluster"), nodes=nodes)
    try:
        cluster.services("cluster-up")
        asyncio.run(cluster.wait_in_sync([]))
    except (ServicesFailed, AssertionError) as exc:
        cluster.services("cluster-down")
        pytest.fail(f"Kafka cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.services("cluster-down")
