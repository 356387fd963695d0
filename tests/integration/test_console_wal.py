"""The console's WAL slot section (issue 51) in a real headless Chromium, beside two real WAL
relays (one reading the slot, one standing by), the console started from a shell that says
OUTBOX_SOURCE=table: it shows the slot and who reads it, and no problem with it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from outbox.settings import OutboxSettings
from tests.support.console import chromium_browser, console_process, shot
from tests.support.relay import RelayProcess
from tests.support.wal import wal_relay_env, wal_source

pytestmark = pytest.mark.integration


async def test_the_slot_section_names_the_relay_reading_and_the_one_standing_by(
    isolated_settings: OutboxSettings, tmp_path: Path
) -> None:
    with wal_source(isolated_settings) as s:
        env = wal_relay_env(s)
        relays = [RelayProcess(env, tmp_path, f"wal-{i}") for i in range(2)]
        try:
            # The shell of the console says table (the default): it still knows the slot.
            shell = {"OUTBOX_WAL__SLOT": s.wal.slot, "OUTBOX_WAL__PUBLICATION": s.wal.publication}
            with console_process(s, **shell) as (url, _):
                async with chromium_browser() as browser:
                    page = await browser.new_page()
                    await page.goto(url + "/")
                    # The page refreshes itself: until one relay reads and one stands by.
                    await page.wait_for_function(
                        "() => (document.querySelector('#wal-reader')?.textContent || '')"
                        ".includes('relay pid') && (document.querySelector('#wal-standby')"
                        "?.textContent || '').includes('relay pid')",
                        timeout=60_000,
                    )
                    reader = await page.inner_text("#wal-reader")
                    standby = await page.inner_text("#wal-standby")
                    host = socket.gethostname()
                    named = {r.pid for r in relays if f"relay pid {r.pid} on {host}" in reader}
                    waiting = {r.pid for r in relays if f"relay pid {r.pid} on {host}" in standby}
                    assert len(named) == 1 and len(waiting) == 1 and named != waiting, (
                        reader,
                        standby,
                    )
                    assert "(backend pid " in reader and "(backend pid " in standby
                    section = await page.inner_text("#wal-section")
                    assert s.wal.slot in section and "reserved" in section, section
                    assert "confirmed LSN" in section and "retained WAL" in section
                    # Read by a relay, although this shell says table: no problem to show,
                    # never the advice to drop the slot, and no lane "owned by no live
                    # relay" (the deployment's relays are WAL relays: they own none).
                    problems = await page.inner_text("#problems")
                    assert "wal_slot" not in problems and "drop" not in problems, problems
                    assert "no live relay" not in problems, problems
                    relays_section = await page.inner_text("#relays-section")
                    assert "owned by no live relay" not in relays_section, relays_section
                    await shot(page, "wal-slot", full=True)
        finally:
            for relay in relays:
                relay.kill()
