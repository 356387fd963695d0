"""The documentation cannot drift from the code.

The settings, CLI and error references are generated from the code when the site is built
(``docs/_hooks/reference.py``); these tests check the generators against an independent
reading of the code, and every page's prose against the code in the other direction: a
setting, command, option or metric the docs mention must exist. The metrics page is
written by hand (the meaning of a series needs more than its help string) and is compared
with the metrics the code registers, both ways.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
import yaml
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, SecretStr, ValidationError

from cli import reference
from cli.app import app
from outbox import settings_doc
from outbox.settings import OutboxSettings
from tests.support.snippets import ROOT, RUN, markers, pages, snippets

DOCS = ROOT / "docs"


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# -- runnable snippets ---------------------------------------------------------------------


def test_every_marked_snippet_is_run_by_a_test() -> None:
    marked = {_rel(p): set(markers(p)) for p in pages() if markers(p)}
    listed = {page: names for page, (names, _) in RUN.items()}
    assert marked == listed, "a marked snippet must be listed in tests/support/snippets.py RUN"
    for page, (names, test) in RUN.items():
        assert set(snippets(page)) == names, f"{page}: a marker without a fenced block after it"
        assert (ROOT / test).is_file(), test


def test_the_canonical_json_test_vector_holds_as_printed() -> None:
    exec(snippets("docs/concepts/canonical-json.md")["test-vector"], {})


_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("page", pages(), ids=_rel)
def test_every_python_block_parses(page: Path) -> None:
    for block in _PYTHON_BLOCK.findall(page.read_text()):
        try:
            compile(block, _rel(page), "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as exc:
            pytest.fail(f"{_rel(page)}: {exc}\n{block}")


# -- settings ------------------------------------------------------------------------------


def _leaves(obj: BaseModel, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Attribute paths of every non-section value of a settings *instance*."""
    found: set[tuple[str, ...]] = set()
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        if isinstance(value, BaseModel):
            found |= _leaves(value, (*path, name))
        else:
            found.add((*path, name))
    return found


def test_the_settings_reference_lists_every_setting() -> None:
    documented = {s.path for s in settings_doc.settings()}
    assert documented == _leaves(OutboxSettings())
    page = settings_doc.reference_markdown()
    missing = [s.env for s in settings_doc.settings() if f"`{s.env}`" not in page]
    assert missing == []


def test_every_documented_variable_is_read_by_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each variable, set alone, reaches its field: the field takes the value, or its
    validation fails at exactly that field."""
    for s in settings_doc.settings():
        # Fits an identifier too (db_schema, table_prefix), but no number, URL or choice.
        given: Any = {"zz_doc_check": 1} if s.type == "JSON object" else "zz_doc_check_"
        with monkeypatch.context() as env:
            env.setenv(s.env, given if isinstance(given, str) else json.dumps(given))
            try:
                value: Any = OutboxSettings()
                for part in s.path:
                    value = getattr(value, part)
            except ValidationError as exc:
                # The field's own check, or its section's check naming the field.
                for e in exc.errors():
                    loc = tuple(map(str, e["loc"]))
                    assert loc == s.path or (loc == s.path[:-1] and s.path[-1] in e["msg"]), s.env
            else:
                if isinstance(value, SecretStr):
                    value = value.get_secret_value()
                assert value == given or str(value) == given, s.env


_ENV = re.compile(r"\bOUTBOX_[A-Z0-9_]*[A-Z0-9]\b(?:__\*|_\*)?")
# Variables that are not settings: the CLI's log level, the scripts' and test services'.
_NOT_SETTINGS = {
    "OUTBOX_LOG_LEVEL",
    "OUTBOX_SERVICES",
    "OUTBOX_SERVICES_DIR",
    "OUTBOX_SECURE_KAFKA_PASSWORD",
    "OUTBOX_CONSOLE_TOKEN",  # docker-compose.yml's variable for the console's token
    "OUTBOX_PG_VERSION",  # scripts/services: PostgreSQL 18 from PyPI instead of Debian's
    "OUTBOX_PG_PORT",  # scripts/services: the PostgreSQL port
}


@pytest.mark.parametrize("page", pages(), ids=_rel)
def test_every_variable_the_docs_mention_exists(page: Path) -> None:
    known = {s.env for s in settings_doc.settings()}
    unknown = []
    for name in set(_ENV.findall(page.read_text())):
        if name.endswith("*"):  # a section, e.g. OUTBOX_KAFKA__*
            ok = any(env.startswith(name.rstrip("*")) for env in known)
        else:
            ok = name in known or name in _NOT_SETTINGS or name.startswith("OUTBOX_TEST_")
        if not ok:
            unknown.append(name)
    assert unknown == [], f"{_rel(page)} mentions variables no setting reads"


# -- CLI -----------------------------------------------------------------------------------


def _typer_commands(t: typer.Typer, path: tuple[str, ...] = ("outbox",)) -> set[str]:
    """Command paths as registered with typer (not through the click tree the generator
    walks); hidden ones left out, as in the reference."""
    found = set()
    for c in t.registered_commands:
        if not c.hidden:
            assert c.callback is not None
            found.add(" ".join((*path, c.name or c.callback.__name__.replace("_", "-"))))
    for g in t.registered_groups:
        assert g.typer_instance is not None
        name = g.name or g.typer_instance.info.name
        sub = (*path, name) if isinstance(name, str) else path
        if isinstance(name, str):
            found.add(" ".join(sub))
        found |= _typer_commands(g.typer_instance, sub)
    return found


def test_the_cli_reference_lists_every_command() -> None:
    generated = {c.name for c in reference.commands()} - {"outbox"}
    assert generated == _typer_commands(app)
    page = reference.cli_markdown()
    for c in reference.commands()[1:]:
        assert f"`{c.name}`" in page
        for flag, _ in c.params:
            assert reference.code_cell(flag) in page, (c.name, flag)


_CODE = re.compile(r"^```([\w-]*)\n(.*?)^```|`([^`\n]+)`", re.S | re.M)
_SHELL = {"", "bash", "sh", "console", "text"}


def _command_lines(text: str) -> list[str]:
    """``outbox ...`` invocations in code spans and shell blocks (comments cut off)."""
    lines = []
    for language, block, span in _CODE.findall(text):
        if block and language not in _SHELL:
            continue
        for line in (block or span).splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("outbox ") and not line.startswith("outbox_"):
                lines.append(re.split(r"\s(?:#|\||&&|;|>)", line)[0])
    return lines


@functools.cache
def _root() -> Any:
    return typer.main.get_command(app)


def _resolve(words: list[str]) -> tuple[Any, Any, list[str]]:
    """The click command ``words`` name, its context, and the words left after it."""
    root = _root()
    cmd, ctx = root, root.context_class(root, info_name="outbox")
    while words and hasattr(cmd, "get_command"):
        sub = cmd.get_command(ctx, words[0])
        if sub is None:
            break
        cmd, ctx = sub, cmd.context_class(sub, parent=ctx, info_name=words[0])
        words = words[1:]
    return cmd, ctx, words


def _alternatives(line: str) -> list[list[str]]:
    """The commands a line names: ``outbox dlq list / show`` is two (sharing the options
    written after the last one)."""
    try:
        words = shlex.split(line.replace("[", " ").replace("]", " "))[1:]
    except ValueError:  # an unbalanced quote in a prose code span
        words = line.split()[1:]
    words = [w for w in words if w not in ("|", "...", "…")]
    if "/" not in words:
        return [words]
    first, *others = " ".join(words).split(" / ")
    base = first.split()
    flags = [w for w in others[-1].split() if w.startswith("-")]
    names = [base[-1], *(o.split()[0] for o in others)]
    return [[*base[:-1], name, *flags] for name in names]


@pytest.mark.parametrize("page", pages(), ids=_rel)
def test_every_command_and_option_the_docs_show_exists(page: Path) -> None:
    root = _root()
    global_options = {o for p in root.params for o in (*p.opts, *p.secondary_opts)}
    problems = []
    for line in _command_lines(page.read_text()):
        resolved = [_resolve(words) for words in _alternatives(line)]
        options = set(global_options)
        for cmd, ctx, rest in resolved:
            if hasattr(cmd, "list_commands") and rest and rest[0][0].isalpha():
                problems.append(f"no command: {line}")
            options |= {o for p in cmd.get_params(ctx) for o in (*p.opts, *p.secondary_opts)}
        flags = {w.split("=", 1)[0] for _, _, rest in resolved for w in rest if w.startswith("-")}
        problems += [f"no option {flag}: {line}" for flag in sorted(flags - options)]
    assert problems == [], f"{_rel(page)}"


# -- metrics -------------------------------------------------------------------------------

METRICS_PAGE = DOCS / "metrics.md"
# The modules that create Prometheus metrics, and how to get an instance of each.
_METRIC_MODULES = {
    "relay/metrics.py",
    "inbox/metrics.py",
    "outbox/effects/metrics.py",
    "outbox/idempotency/metrics.py",
    "outbox/console/metrics.py",
}


def _registered_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposed name -> (type, label names) of every metric the code registers."""
    from inbox.metrics import Metrics
    from outbox.console.metrics import ConsoleMetrics
    from outbox.effects.metrics import EffectMetrics
    from outbox.idempotency.metrics import IdempotencyMetrics
    from relay.metrics import RelayMetrics

    registries = [RelayMetrics().registry, Metrics("c").registry]
    for make in (EffectMetrics, IdempotencyMetrics, ConsoleMetrics):
        registry = CollectorRegistry()
        make(registry)
        registries.append(registry)
    found = {}
    for registry in registries:
        for collector in registry._collector_to_names:
            kind = collector._type  # type: ignore[attr-defined]
            name = collector._name + ("_total" if kind == "counter" else "")  # type: ignore[attr-defined]
            found[name] = (kind, tuple(collector._labelnames))  # type: ignore[attr-defined]
    return found


def test_metrics_are_created_only_where_the_docs_test_looks() -> None:
    makers = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
    sites = set()
    for package in reference.PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in makers
                ):
                    sites.add(path.relative_to(ROOT).as_posix())
    assert sites == _METRIC_MODULES, "add the new module's metrics to _registered_metrics()"


def _documented_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \|([^|]*)\|", METRICS_PAGE.read_text(), re.M)
    return {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


# Series the dashboard and alerts use that other software exports.
_EXTERNAL = {"kafka_consumergroup_lag", "up"}


def test_the_metrics_page_lists_every_metric_with_its_type_and_labels() -> None:
    documented = _documented_metrics()
    ours = {name: row for name, row in documented.items() if name not in _EXTERNAL}
    assert ours == _registered_metrics()


_METRIC_NAME = re.compile(r"\boutbox_(?:relay|inbox|effects|idempotency|console)_[a-z_]+")


@pytest.mark.parametrize("page", pages(), ids=_rel)
def test_every_metric_the_docs_mention_exists(page: Path) -> None:
    # A counter may be named by its family too (outbox_relay_errors for ..._total).
    known = {n.removesuffix("_total") for n in _registered_metrics()} | set(_registered_metrics())
    mentioned = {
        re.sub(r"_(bucket|sum|count)$", "", m) for m in _METRIC_NAME.findall(page.read_text())
    }
    assert mentioned - known == set(), _rel(page)


_PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "count",
    "rate",
    "increase",
    "absent",
    "and",
    "or",
    "unless",
    "label_replace",
    "time",
    "vector",
    "max_over_time",
    "min_over_time",
    "delta",
}


def test_every_metric_the_alerts_use_exists() -> None:
    groups = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]
    used = set()
    for rule in (r for g in groups for r in g["rules"]):
        # Label matchers, grouping clauses, ranges and strings (label_replace's label
        # names) name no series.
        expr = re.sub(
            r'\{[^}]*\}|\b(?:by|on|without|ignoring)\s*\([^)]*\)|\[[^\]]*\]|"[^"]*"',
            " ",
            rule["expr"],
        )
        used |= set(re.findall(r"\b[a-z_][a-z0-9_]*\b", expr)) - _PROMQL_WORDS
    assert used - set(_registered_metrics()) - _EXTERNAL == set()


# -- errors --------------------------------------------------------------------------------


def _error_classes_in_source() -> set[str]:
    """Names of classes deriving, directly or not, from OutboxError, read with ``ast``."""
    bases: dict[str, set[str]] = {}
    for package in reference.PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {
                        b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                        for b in node.bases
                    }
                    bases.setdefault(node.name, set()).update(names)
    errors = {"OutboxError"}
    while grown := {n for n, b in bases.items() if b & errors} - errors:
        errors |= grown
    return errors


def test_the_error_reference_lists_every_error_with_a_docstring() -> None:
    classes = reference.error_classes()
    assert {c.__name__ for c in classes} == _error_classes_in_source()
    assert [c.__name__ for c in classes if not (c.__doc__ or "").strip()] == []
    page = reference.errors_markdown()
    for c in classes:
        assert f"### `{c.__name__}`" in page
        assert f"retriable: **{reference.retriable(c)}**" in page


def test_retriable_is_read_from_the_classes() -> None:
    from outbox.errors import BrokerUnavailable, SchemaMissing
    from outbox.resilience import HttpStatusError

    assert reference.retriable(BrokerUnavailable) == "yes"
    assert reference.retriable(SchemaMissing) == "no"
    assert reference.retriable(HttpStatusError) == "by instance"


def test_the_error_reference_renders_the_sqlstate_table() -> None:
    from outbox.dberrors import SQLSTATES

    page = reference.database_errors_markdown()
    for code, (_kind, meaning) in SQLSTATES.items():
        assert f"`{code}`" in page and meaning.replace("|", "\\|") in page, code
    assert "<!-- generated: database-errors -->" in (ROOT / "docs/reference/errors.md").read_text()


def test_the_documented_dead_letter_states_are_the_codes() -> None:
    """docs/howto/poison-event.md's table of states is the one `outbox dlq` and the console
    show (outbox/ops/deadletters.py), and every status the inbox writes has one."""
    import dataclasses

    from inbox import sql
    from outbox.ops.deadletters import DEAD_LETTER_STATES, DeadLetter

    page = (DOCS / "howto" / "poison-event.md").read_text()
    table = page[page.index("| state | meaning |") :].split("\n\n", 1)[0]
    documented = dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", table, re.M))
    assert {k: v.replace("`", "") for k, v in documented.items()} == DEAD_LETTER_STATES
    blank = {f.name: None for f in dataclasses.fields(DeadLetter)}
    statuses = (sql.DEAD_LETTERED, sql.REPLAYING, sql.PROCESSED, None)
    states = {DeadLetter(**{**blank, "inbox_status": s}).state for s in statuses}  # type: ignore[arg-type]
    assert states == set(DEAD_LETTER_STATES)
    listing = next(c for c in reference.commands() if c.name == "outbox dlq list").help
    assert all(state in listing for state in DEAD_LETTER_STATES), listing


def test_failed_row_retry_is_described_as_the_code_does_it() -> None:
    """`outbox failed retry` keeps the event id and writes a new outbox row (the test
    tests/acceptance/test_cli_polish.py checks the rows); every description says so, none
    says "same id" or "new ids" without saying which id."""
    help_text = next(c for c in reference.commands() if c.name == "outbox failed retry").help
    assert "the same event id" in help_text and "new outbox row" in help_text, help_text
    for page, words in (
        ("howto/poison-event.md", ("keeps its **event id**", "**new outbox row**")),
        ("howto/console.md", ("the same event id in a new outbox row",)),
        ("concepts/claim-cursor.md", ("new row ids (their event ids stay)",)),
    ):
        text = " ".join((DOCS / page).read_text().split())
        assert all(w in text for w in words), (page, words)
    for page in pages():
        text = " ".join(page.read_text().split())
        for vague in ("same id, attempts reset", "outbox with new ids"):
            assert vague not in text, (_rel(page), vague)
