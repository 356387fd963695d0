"""Which relay runs the maintenance services: the one whose registration connection holds
the maintenance lock, a session advisory lock of the deployment's own namespace
(relay/store.py). Every relay tries it at each heartbeat until it wins; PostgreSQL releases
it when the holder's session ends — the process stopped or was killed, its connection
died — so another relay takes over within a heartbeat. A relay that loses its connection
stops its services at once (another may be taking the lock meanwhile; their rounds skip
each other's rows, so a moment of both is harmless).
"""

from __future__ import annotations

from relay.database import Connection
from relay.maintenance import Maintenance
from relay.store import RelayStore


class Leadership:
    def __init__(self, store: RelayStore, maintenance: Maintenance) -> None:
        self._store = store
        self._maintenance = maintenance

    @property
    def leading(self) -> bool:
        return self._maintenance.leading

    async def hold(self, conn: Connection) -> bool:
        """On the registration connection, at a heartbeat: try the lock unless this session
        holds it; start the services on winning. True while this relay leads."""
        if not self.leading:
            row = await (await conn.execute(self._store.lead_maintenance)).fetchone()
            if row is not None and row[0]:
                self._maintenance.elected()
        return self.leading

    async def lost(self) -> None:
        """The registration connection is gone, and the lock with it."""
        await self._maintenance.deposed()
