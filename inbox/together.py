"""The shared transaction: the short runs of several partitions in one transaction.

When several partitions each have a small run ready at once (the sharer of
``inbox/runner.py`` offers them), the per-transaction cost (claim, flush, commit; about
all the CPU at a few events per run) is paid once for all of them. Each partition's
marker must cover its run first (armed ahead by its previous commit, else armed now: one
autocommit statement for all that need it), then one transaction claims every run,
handles each partition's records in offset order and arms every marker ahead; offsets
move only after that commit. A crash inside it leaves each partition's marker armed,
exactly as concurrent per-partition runs would. If it fails, it is rolled back and every
partition runs alone again (its marker is still armed for it, so that costs no marker
write); the partition whose handler raised resumes from that failure as after a failed
run of its own (first attempt counted), in its own lane so its retries block no other
partition. A failure no handler raised (a write refused at the final flush, the commit)
cannot be pinned on a partition: each runs its next run alone, where the savepoint per
event finds it (sharing again would fail again, forever).
"""

from __future__ import annotations

from collections.abc import Sequence

from inbox.event import InboxEvent
from inbox.marker import ahead, arm_together
from inbox.processor import PartitionProcessor
from inbox.transaction import RolledBack, transaction


async def process_together(
    members: Sequence[tuple[PartitionProcessor, Sequence[InboxEvent]]],
) -> None:
    """Handle several partitions' runs (from :meth:`PartitionProcessor.ready_run`) in one
    transaction (see the module docstring). Whatever is not finished when this returns is
    left to each partition's own :meth:`PartitionProcessor.process`."""
    try:
        # Most members' markers are armed ahead by their previous commit already.
        uncovered = [(p.marker, run) for p, run in members if not p.marker.covers(run)]
        if uncovered:
            await arm_together(uncovered)
        armed = [ahead(run) for _, run in members]
        for (p, _), marker in zip(members, armed, strict=True):
            p.marker.arming(marker)
        arm = [p.marker.arm(marker) for (p, _), marker in zip(members, armed, strict=True)]
        try:
            fresh, unique = await transaction(
                members[0][0].connections, [(p.dispatch, run) for p, run in members], arm
            )
        except RolledBack as stop:
            if stop.at is not None:
                p, run = members[stop.at[0]]
                p.resume_next(run[stop.at[1]].offset, stop.cause)
            else:
                for p, _ in members:
                    p.alone_next()
            return
    except BaseException:
        for p, _ in members:
            p.forget()
        raise
    for (p, run), marker in zip(members, armed, strict=True):
        await p.committed_run(run, marker, fresh, unique)
