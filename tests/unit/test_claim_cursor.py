"""The claim horizon and lane cursors (relay/sources/table/cursor.py): pure logic, no database."""

from __future__ import annotations

import random

from relay.sources.table.cursor import (
    LANE_START,
    MAX_OPEN_READINGS,
    ClaimCursors,
    Horizon,
    Reading,
    settled,
)


def reading(last_id: int, *writers: str, at: float = 0.0) -> Reading:
    return Reading(last_id, frozenset(writers), at)


def test_a_reading_without_writers_is_final_at_once() -> None:
    h = Horizon()
    h.observe(reading(10, at=1.0))
    assert (h.value, h.reached_at) == (10, 1.0)


def test_a_reading_waits_until_none_of_its_writers_is_left() -> None:
    h = Horizon()
    h.observe(reading(10, "3/7", "4/9"))
    assert h.value is None
    h.observe(reading(12, "4/9", "5/1"))  # 3/7 ended, 4/9 still open
    assert h.value is None
    h.observe(reading(15, "5/1"))  # 4/9 ended: 10 is final; 12 waits for 5/1
    assert h.value == 10
    h.observe(reading(15, "6/2"))  # 5/1 ended: 12 and (the first) 15 are final
    assert h.value == 15


def test_an_outbox_writer_left_open_holds_the_horizon_only_at_its_ids() -> None:
    """The case the design cannot help: a writer idle in transaction. The horizon stops
    just where it was and moves on to a recent value as soon as the writer ends."""
    h = Horizon()
    h.observe(reading(100, at=0.0))
    h.observe(reading(101, "9/9", at=1.0))  # the writer took id 101 and stays open
    for t in range(2, 500):
        h.observe(reading(100 + t, "9/9", f"1/{t}", at=float(t)))
        assert h.value == 100
        assert h.blockers(frozenset({"9/9", f"1/{t}"})) == {"9/9"}
    assert h.waiting_since == 1.0
    h.observe(reading(700, at=600.0))
    assert h.value == 700 and h.waiting_since is None


def test_open_readings_are_bounded_and_the_newest_is_kept() -> None:
    h = Horizon()
    for i in range(10 * MAX_OPEN_READINGS):
        h.observe(reading(i, "stuck"))
    assert len(h._open) == MAX_OPEN_READINGS
    h.observe(reading(10_000))
    assert h.value == 10_000


def test_the_horizon_never_moves_backwards() -> None:
    rng = random.Random(5)
    h = Horizon()
    last = 0
    seen: list[int] = []
    for step in range(2000):
        last += rng.randint(0, 3)
        writers = {f"{rng.randint(1, 5)}/{rng.randint(1, 20)}" for _ in range(rng.randint(0, 3))}
        h.observe(Reading(last, frozenset(writers), float(step)))
        if h.value is not None:
            seen.append(h.value)
    assert seen == sorted(seen) and seen


def test_a_sequence_going_backwards_forgets_everything() -> None:
    cursors = ClaimCursors()
    cursors.observe(reading(50))
    plan = cursors.start([0])
    cursors.settle(plan, {0: None}, [])
    assert cursors.known() == {0: 50}
    assert not cursors.observe(reading(3))
    assert cursors.known() == {} and cursors.horizon.value is None
    cursors.settle(plan, {0: None}, [])  # a claim sent before the reset changes nothing
    assert cursors.known() == {}


def test_settled_bound() -> None:
    assert settled(100, None, None) == 100
    assert settled(100, 40, None) == 39  # a row still pending (waiting, or locked)
    assert settled(100, None, 70) == 69  # a row of the batch Kafka did not acknowledge
    assert settled(100, 80, 70) == 69


def test_no_horizon_no_cursor() -> None:
    cursors = ClaimCursors()
    plan = cursors.start([1, 2])
    assert plan.after == [LANE_START, LANE_START] and plan.horizon is None
    cursors.settle(plan, {1: None, 2: 5}, [])
    assert cursors.known() == {}


def test_only_lanes_the_probe_answered_for_move() -> None:
    """A lane whose fence the transaction did not hold is absent from the probe's answer:
    another transaction may be changing it."""
    cursors = ClaimCursors()
    cursors.observe(reading(1000))
    plan = cursors.start([1, 2, 3])
    cursors.settle(plan, {1: None, 3: 400}, [(1, 900), (1, 950)])
    assert cursors.known() == {1: 899, 3: 399}
    assert cursors.start([1, 2, 3]).after == [899, LANE_START, 399]


def test_cursors_only_move_up_and_a_stale_plan_cannot_lower_them() -> None:
    cursors = ClaimCursors()
    cursors.observe(reading(500))
    late = cursors.start([0])  # sent early, with the same horizon
    cursors.settle(cursors.start([0]), {0: None}, [])
    assert cursors.known() == {0: 500}
    cursors.settle(late, {0: 300}, [])
    assert cursors.known() == {0: 500}


def test_stranded_rows_reset_their_lanes_and_in_flight_claims_settle_nothing() -> None:
    cursors = ClaimCursors()
    cursors.observe(reading(1000))
    cursors.settle(cursors.start([0, 1, 2]), {0: None, 1: None, 2: None}, [])
    before = cursors.known()
    in_flight = cursors.start([0, 1, 2])
    # Lane 1 has a pending row at its cursor, lane 2 one above it: only lane 1 is reset.
    assert cursors.stranded(before, {1: 1000, 2: 1001, 7: 3}) == [1]
    assert cursors.known() == {0: 1000, 2: 1000}
    cursors.settle(in_flight, {0: None, 1: None, 2: None}, [])
    assert cursors.start([1]).after == [LANE_START]


def test_only_lanes_behind_the_horizon_are_probed() -> None:
    cursors = ClaimCursors()
    assert cursors.start([0, 1]).behind == []  # no horizon yet
    cursors.observe(reading(100))
    cursors.settle(cursors.start([0]), {0: None}, [])
    assert cursors.start([0, 1]).behind == [(1, LANE_START)]
    cursors.observe(reading(120))
    assert cursors.start([0, 1]).behind == [(0, 100), (1, LANE_START)]
