"""docker-compose.yml, the Dockerfile and .dockerignore, checked without a Docker engine:
exact image tags, a healthcheck on every long-running service, one-shots the daemons wait
for, the topics the example needs, and a build context without the virtualenv."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# An exact version: at least MAJOR.MINOR (PostgreSQL's minor is its patch level).
EXACT_TAG = re.compile(r"^\d+\.\d+(\.\d+)?(-[a-z0-9.-]+)?$")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    found: dict[str, Any] = compose["services"]
    return found


def _one_shot(service: dict[str, Any]) -> bool:
    return bool(service.get("restart") == "no")


def test_every_image_tag_is_an_exact_version(services: dict[str, Any]) -> None:
    images = [s["image"] for s in services.values() if "image" in s]
    dockerfile = (ROOT / "Dockerfile").read_text()
    images += re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    assert len(images) >= 3  # postgres, kafka, the Dockerfile's base (the app builds)
    for image in images:
        tag = image.partition(":")[2]
        assert EXACT_TAG.match(tag), f"{image}: pin an exact version, not {tag or 'no tag'!r}"


def test_every_long_running_service_has_a_healthcheck(services: dict[str, Any]) -> None:
    daemons = {name: s for name, s in services.items() if not _one_shot(s)}
    assert set(daemons) == {
        "postgres",
        "kafka",
        "relay",
        "consumer",
        "console",
        "kafka-secure",
        "relay-secure",
        "consumer-secure",
    }
    for name, service in daemons.items():
        check = service.get("healthcheck", {})
        assert check.get("test"), f"{name} has no healthcheck"
        assert {"interval", "timeout", "retries"} <= set(check), name


def test_daemon_healthchecks_probe_their_own_healthz(services: dict[str, Any]) -> None:
    for name in ("relay", "consumer", "relay-secure", "consumer-secure"):
        service = services[name]
        port = service["command"][service["command"].index("--metrics-port") + 1]
        assert f"http://127.0.0.1:{port}/healthz" in service["healthcheck"]["test"]


def test_daemons_wait_for_the_one_shots_and_healthy_dependencies(
    services: dict[str, Any],
) -> None:
    one_shots = {name for name, s in services.items() if _one_shot(s)}
    assert one_shots == {"migrate", "topics-init", "certs-init", "secure-init"}
    waits = {
        ("relay", "consumer"): ("migrate", "topics-init"),
        ("relay-secure", "consumer-secure"): ("migrate", "secure-init"),
    }
    for names, shots in waits.items():
        for name in names:
            for shot in shots:
                done = {"condition": "service_completed_successfully"}
                assert services[name]["depends_on"][shot] == done, name
    for name, service in services.items():
        for dependency, how in service.get("depends_on", {}).items():
            expected = (
                "service_completed_successfully" if dependency in one_shots else "service_healthy"
            )
            assert how == {"condition": expected}, f"{name} -> {dependency}"


def test_topics_init_creates_the_example_topics_idempotently(services: dict[str, Any]) -> None:
    # `outbox topics ensure` is idempotent (tests/acceptance/test_topics_cli.py): the relay's
    # topic with its partitions, the consumer app's topics and their dead-letter topics.
    command = services["topics-init"]["command"]
    assert command[:3] == ["outbox", "topics", "ensure"]
    assert "shop.orders:6" in command and "examples.shop.consumer:app" in command
    assert services["topics-init"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "kafka": {"condition": "service_healthy"},
    }


def test_build_context_leaves_out_venv_services_caches_and_git() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".services", ".cache", ".git", "**/__pycache__"} <= ignored
    copied = re.findall(r"^COPY\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert not ignored & set(copied), "the Dockerfile copies something .dockerignore drops"


# ------------------------------------------------------------------ profile "secure"

SECURE = ("certs-init", "kafka-secure", "secure-init", "relay-secure", "consumer-secure")


def test_the_secure_profile_is_optional(services: dict[str, Any]) -> None:
    for name in SECURE:
        assert services[name]["profiles"] == ["secure"], name
    assert "secure" in services["migrate"]["profiles"]  # the secure daemons need the tables


def test_the_secure_broker_lets_clients_in_only_over_sasl_ssl(services: dict[str, Any]) -> None:
    broker = services["kafka-secure"]["environment"]
    protocols = dict(
        p.split(":") for p in broker["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    advertised = dict(a.split("://") for a in broker["KAFKA_ADVERTISED_LISTENERS"].split(","))
    published = services["kafka-secure"]["ports"]
    assert published == ["127.0.0.1:39094:9094"]  # only the host's SASL_SSL listener
    assert advertised["SASL_SSL"] == "127.0.0.1:39094" and protocols["SASL_SSL"] == "SASL_SSL"
    assert protocols["DOCKER_SASL_SSL"] == "SASL_SSL"
    assert broker["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    for listener in ("SASL__SSL", "DOCKER__SASL__SSL"):
        jaas = broker[f"KAFKA_LISTENER_NAME_{listener}_SCRAM___SHA___512_SASL_JAAS_CONFIG"]
        assert "ScramLoginModule" in jaas
    assert broker["KAFKA_SSL_KEYSTORE_FILENAME"] == "broker.p12"


def test_certificates_and_users_come_from_one_shots_with_the_brokers_tools(
    services: dict[str, Any],
) -> None:
    certs, init = services["certs-init"], services["secure-init"]
    assert certs["image"] == init["image"] == services["kafka-secure"]["image"]
    script = " ".join(certs["command"])
    for step in ("-genkeypair", "-gencert", "-exportcert", "ca.pem", "broker.p12", "SAN="):
        assert step in script, step
    assert "secure-certs:/certs" in certs["volumes"]
    setup = " ".join(init["command"])
    assert "kafka-configs.sh" in setup and "SCRAM-SHA-512=" in setup
    assert "--if-not-exists" in setup and "shop.orders shop.orders.dlq" in setup


def test_the_secure_daemons_are_configured_with_real_settings(services: dict[str, Any]) -> None:
    from outbox.settings_doc import rows

    known = {env for env, _, _ in rows()}
    for name in ("relay-secure", "consumer-secure"):
        env = services[name]["environment"]
        assert set(env) <= known, set(env) - known
        assert env["OUTBOX_KAFKA__SECURITY_PROTOCOL"] == "SASL_SSL"
        assert env["OUTBOX_KAFKA__SASL_MECHANISM"] == "SCRAM-SHA-512"
        assert env["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"] == "kafka-secure:29094"
        # the password comes from the operator's environment (a default for the demo only)
        assert env["OUTBOX_KAFKA__SASL_PASSWORD"].startswith("${OUTBOX_SECURE_KAFKA_PASSWORD")
        assert env["OUTBOX_KAFKA__SSL_CA_FILE"] == "/certs/ca.pem"
        assert "secure-certs:/certs:ro" in services[name]["volumes"]


def test_the_console_listens_beyond_loopback_only_with_a_token(services: dict[str, Any]) -> None:
    console = services["console"]
    command = console["command"]
    assert command[:2] == ["outbox", "console"] and "--allow-actions" not in command
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert console["environment"]["OUTBOX_CONSOLE__TOKEN"]
    assert all(p.startswith("127.0.0.1:") for p in console["ports"])
    assert "/healthz" in console["healthcheck"]["test"][-1]
