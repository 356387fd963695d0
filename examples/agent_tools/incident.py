"""The seeds' Sunday incident, runnable: a refund of 14,000.00 that the provider applies
three times without the client ever hearing back (the connection dies each time), and an
agent that crashes and resumes from its journal, re-deciding the same refund.

Without the ledger: four refunds. With it: one — the first ambiguous outcome is reconciled
by key, and a crash after the tool returned is replayed from the ledger on resume.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from pathlib import Path

from examples.agent_tools.agent import AgentLoop, Journal, Run, ScriptedModel, Tool, orchestrate
from examples.agent_tools.provider import FakeProvider

CHARGE = "ch_sunday"
AMOUNT = 1_400_000  # minor units: 14,000.00


@dataclass(frozen=True)
class IncidentResult:
    run: Run
    effects: int  # refunds the provider made during this run


def replay_incident(
    provider: FakeProvider, workdir: Path, tool: Tool, crash_after_first_tool: bool = False
) -> IncidentResult:
    """Run one agent through the incident; count the refunds it caused."""
    provider.clear_faults()
    provider.fail_next("apply_then_die", 3)
    before = provider.effects
    run_id = str(uuid.uuid4())
    journal = Journal(workdir / f"journal-{run_id}.jsonl")
    model = ScriptedModel(CHARGE, AMOUNT)
    crashes = itertools.chain([crash_after_first_tool], itertools.repeat(False))
    run = orchestrate(
        lambda: AgentLoop(run_id, journal, model, {"issue_refund": tool}, lambda: next(crashes))
    )
    provider.clear_faults()
    return IncidentResult(run, provider.effects - before)
