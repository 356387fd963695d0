"""The package layout's import rules, read from the source with ``ast``.

Dependencies point one way: ``cli -> relay | inbox -> outbox``. Inside ``outbox/`` the core
(the root package's own modules, and its Kafka room ``outbox/kafka/``) imports no
subpackage, and the subpackages are ordered: ``resilience -> idempotency -> effects -> ops
-> console`` may each import the ones before it and the core, never one after it. No import
cycle between modules, counting imports inside functions and under ``TYPE_CHECKING`` too: a
cycle hidden from the interpreter is still one for a reader. No module over
``MAX_MODULE_LINES`` lines: one that grows past it is split along its jobs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outbox", "relay", "inbox", "cli")

# Each layer may import itself and the layers listed for it.
ALLOWED: dict[str, set[str]] = {
    "outbox": set(),
    "outbox.resilience": {"outbox"},
    "outbox.idempotency": {"outbox", "outbox.resilience"},
    "outbox.effects": {"outbox", "outbox.resilience", "outbox.idempotency"},
    "outbox.ops": {"outbox", "outbox.resilience", "outbox.idempotency", "outbox.effects"},
    "outbox.console": {
        "outbox",
        "outbox.resilience",
        "outbox.idempotency",
        "outbox.effects",
        "outbox.ops",
    },
    "relay": {"outbox", "outbox.resilience", "outbox.idempotency", "outbox.effects", "outbox.ops"},
    "inbox": {"outbox", "outbox.resilience", "outbox.idempotency", "outbox.effects", "outbox.ops"},
}
ALLOWED["cli"] = {"relay", "inbox", "outbox.console", *ALLOWED["relay"]}
# Subpackages that are rooms of the core, not layers above it: the Kafka room (every use of
# the Kafka client library) is imported by the core as by everyone.
CORE_ROOMS = {"outbox.kafka"}
MAX_MODULE_LINES = 600


def modules(root: Path) -> dict[str, Path]:
    """Every module of the project packages under ``root``, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.relative_to(root).parts:
                continue  # Alembic scripts, loaded by Alembic, never imported
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The project modules that module ``name`` imports, with line numbers."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                source = ".".join([*prefix, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                # `from outbox import identifiers` imports a module, not the package.
                sub = f"{source}.{alias.name}"
                yield (sub if sub in known else source), node.lineno


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "outbox" and len(parts) > 1 and f"outbox.{parts[1]}" in CORE_ROOMS:
        return "outbox"
    if parts[0] == "outbox" and len(parts) > 1 and f"outbox.{parts[1]}" in ALLOWED:
        return f"outbox.{parts[1]}"
    return parts[0]


def back_edges(root: Path) -> list[str]:
    known = modules(root)
    problems = []
    for name, path in known.items():
        for target, line in imports(name, path, known):
            src, dst = layer(name), layer(target)
            if dst != src and dst not in ALLOWED[src]:
                where = f"{path.relative_to(root)}:{line}"
                problems.append(f"{where}: {name} ({src}) imports {target} ({dst})")
    return problems


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    known = modules(root)
    graph = {
        n: {t for t, _ in imports(n, p, known) if t in known and t != n} for n, p in known.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_imports_point_one_way() -> None:
    assert back_edges(ROOT) == []


def test_no_import_cycles() -> None:
    assert cycles(ROOT) == []


def oversized(root: Path) -> list[str]:
    """The modules of the project packages over ``MAX_MODULE_LINES`` lines, with their
    length."""
    found = []
    for path in modules(root).values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return sorted(found)


def test_no_module_is_over_the_size_limit() -> None:
    problems = oversized(ROOT)
    assert problems == [], f"over {MAX_MODULE_LINES} lines, split along their jobs: {problems}"


def test_an_oversized_module_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"relay/big.py": "x = 1\n" * (MAX_MODULE_LINES + 1)})
    assert oversized(root) == [f"relay/big.py: {MAX_MODULE_LINES + 1} lines"]


def test_every_layer_is_known() -> None:
    """A new subpackage of ``outbox`` must be placed in the order above, not slip through as
    part of the core."""
    subpackages = {
        f"outbox.{p.name}" for p in (ROOT / "outbox").iterdir() if (p / "__init__.py").exists()
    }
    assert subpackages - {"outbox.migrations"} <= set(ALLOWED) | CORE_ROOMS


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("outbox/core.py", "from relay.daemon import Relay\n"),
        ("outbox/core.py", "from outbox.ops import lag\n"),
        ("outbox/resilience/retry.py", "from outbox.ops.lag import collect\n"),
        ("relay/daemon.py", "import inbox.runner\n"),
        ("inbox/runner.py", "from cli.app import main\n"),
        ("outbox/ops/lag.py", "def f():\n    from relay import daemon\n"),
    ],
)
def test_a_back_edge_is_found(tmp_path: Path, rel: str, text: str) -> None:
    root = _tree(
        tmp_path,
        {
            rel: text,
            "outbox/ops/__init__.py": "",
            "outbox/ops/lag.py": "",
            "outbox/resilience/__init__.py": "",
            "relay/daemon.py": "",
            "inbox/runner.py": "",
            "cli/app.py": "",
            **{rel: text},
        },
    )
    assert len(back_edges(root)) == 1


def test_a_cycle_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "outbox/a.py": "from outbox import b\n",
            "outbox/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from outbox.a import X\n"
            ),
        },
    )
    assert cycles(root) == [["outbox.a", "outbox.b"]]
