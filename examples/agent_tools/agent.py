"""A tool-calling agent loop with a durable journal, a scripted model and a refund tool.

The loop asks the model for the next step, writes the tool call to its journal, runs the
tool, writes the result. When the process dies mid-step the orchestrator starts a new loop
from the journal: the model sees no result for the refund and re-emits the same call (with
a freshly worded ``reason``, as models do). Two refund tools:

* :class:`UnguardedRefundTool` — the seeds' incident: an idempotency key is generated
  *inside* the wrapper, so every retry above it is a brand-new refund;
* :class:`LedgerRefundTool` — the key derives from the intent (run, step, tool and the
  arguments that distinguish the action) and the call goes through the effect ledger.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Engine

from examples.agent_tools.client import ProviderClient
from outbox.canonical import idempotency_key
from outbox.effects import NOT_APPLIED, Effects
from outbox.errors import OutboxError
from outbox.idempotency import strip_fields

# What the model rewrites on every attempt without changing the action: not part of the key.
VOLATILE_FIELDS = ("reason",)


class Crash(BaseException):
    """The process died here (a deploy evicted it): nothing after this point ran."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, Any]


class Journal:
    """The loop's durable record: one JSON object per line, flushed and fsynced per entry."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def append(self, entry: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()

    def completed_steps(self) -> int:
        return sum(1 for e in self.entries() if e["type"] == "tool_result")

    def transcript(self) -> list[dict[str, Any]]:
        """What the model is shown: finished tool calls and their results. A call without a
        result (the process died during it) is not shown — the model decides again."""
        return [e for e in self.entries() if e["type"] in ("tool_result", "final")]


class ScriptedModel:
    """A fake model (no network): refund once, then answer. Each decision words its
    ``reason`` differently, like a model re-prompted after a crash."""

    def __init__(self, charge: str, amount: int) -> None:
        self.charge = charge
        self.amount = amount
        self.decisions = 0

    def next(self, transcript: list[dict[str, Any]]) -> ToolCall | str:
        self.decisions += 1
        results = [e for e in transcript if e["type"] == "tool_result"]
        if not results:
            reason = f"customer asked for a refund (decision {self.decisions})"
            return ToolCall(
                "issue_refund", {"charge": self.charge, "amount": self.amount, "reason": reason}
            )
        return f"Refunded {self.amount} on {self.charge} as {results[-1]['content']['id']}."


class Tool(Protocol):
    def __call__(self, run_id: str, step: int, args: dict[str, Any]) -> Any: ...


class UnguardedRefundTool:
    """The incident: a fresh key per call — it protects nothing above this wrapper."""

    def __init__(self, client: ProviderClient) -> None:
        self.client = client

    def __call__(self, run_id: str, step: int, args: dict[str, Any]) -> Any:
        return self.client.refund(args["charge"], args["amount"], idempotency_key=str(uuid.uuid4()))


class LedgerRefundTool:
    """The fix: key from intent, claim before the call, reconcile an ambiguous outcome."""

    def __init__(self, client: ProviderClient, effects: Effects, engine: Engine) -> None:
        self.client = client
        self.effects = effects
        self.engine = engine

    def __call__(self, run_id: str, step: int, args: dict[str, Any]) -> Any:
        action = strip_fields(args, VOLATILE_FIELDS)
        key = idempotency_key("agent-tool", run_id, step, "issue_refund", payload=action)

        def reconcile(k: str) -> Any:
            found = self.client.find_refund(k)
            return NOT_APPLIED if found is None else found

        return self.effects.run(
            self.engine,
            key=key,
            payload=action,
            call=lambda k: self.client.refund(action["charge"], action["amount"], k),
            reconcile=reconcile,
            window=timedelta(days=30),
            dependency="payments",
        )


class AgentLoop:
    """One process lifetime of the agent; resumes from whatever the journal holds."""

    def __init__(
        self,
        run_id: str,
        journal: Journal,
        model: ScriptedModel,
        tools: dict[str, Tool],
        crash_after_tool: Callable[[], bool] = lambda: False,
    ) -> None:
        self.run_id = run_id
        self.journal = journal
        self.model = model
        self.tools = tools
        self.crash_after_tool = crash_after_tool

    def run(self) -> str:
        while True:
            decision = self.model.next(self.journal.transcript())
            if isinstance(decision, str):
                self.journal.append({"type": "final", "content": decision})
                return decision
            # The step number comes from the journal, so a resumed loop reuses it.
            step = self.journal.completed_steps() + 1
            self.journal.append(
                {"type": "tool_call", "step": step, "name": decision.name, "args": decision.args}
            )
            result = self.tools[decision.name](self.run_id, step, decision.args)
            if self.crash_after_tool():
                raise Crash("killed after the tool returned, before its result was journaled")
            self.journal.append({"type": "tool_result", "step": step, "content": result})


@dataclass(frozen=True)
class Run:
    answer: str
    restarts: int


def orchestrate(make_loop: Callable[[], AgentLoop], max_restarts: int = 10) -> Run:
    """Run the loop; whenever it dies (a crash, an unhandled tool error) start a new one from
    the journal, as a durable runtime does. A retriable framework error (the effect is in
    progress elsewhere) is waited out the same way."""
    for restarts in range(max_restarts + 1):
        try:
            return Run(make_loop().run(), restarts)
        except (Crash, Exception) as exc:
            if isinstance(exc, OutboxError):
                if not exc.retriable:
                    raise
                time.sleep(min(float(getattr(exc, "retry_after", 0.1)), 5.0))
            continue
    raise RuntimeError(f"the agent did not finish after {max_restarts} restarts")
