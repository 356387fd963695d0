"""A handler failure as a dead letter keeps it (inbox/traces.py, inbox/failures.py): the
frames with their source lines and no locals, the framework's own frames left out, chained
causes kept, the message without the payload or a password, bounded."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from pydantic import BaseModel

from inbox import failures, traces
from tests.support.failing_helpers import FAILING_LINE, invoice_total

SECRET_URL = "postgresql://svc:pw@db.internal:5432/pay"
HELPER = "tests/support/failing_helpers.py"


def _caught(fn: object, *args: object) -> BaseException:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as exc:
        return exc
    raise AssertionError("did not raise")


def test_a_helper_failure_names_the_helper_file_and_line() -> None:
    exc = _caught(invoice_total, {"lines": [{"qty": 1}]})
    failure = failures.classify(exc, 500)
    assert failure.frame == f"{HELPER}:{FAILING_LINE} in _line_total"
    assert failure.trace is not None
    assert f'failing_helpers.py", line {FAILING_LINE}, in _line_total' in failure.trace
    assert "return line.total * line" in failure.trace  # the source line
    assert failure.trace.endswith("AttributeError: 'dict' object has no attribute 'total'\n")
    summary = traces.summary(failure.trace)
    assert summary.startswith(f"failing_helpers.py:{FAILING_LINE} in _line_total < ")


def test_no_locals_and_no_secret_and_chained_causes_kept() -> None:
    def connect() -> None:
        password = "pw-in-a-local-never-shown"  # noqa: F841 - a local the trace must not show
        raise ConnectionError(f"could not reach {SECRET_URL}")

    def handler() -> None:
        try:
            connect()
        except ConnectionError as exc:
            raise RuntimeError("ledger unavailable") from exc

    failure = failures.classify(_caught(handler), 500)
    trace = failure.trace or ""
    assert "pw-in-a-local-never-shown" not in trace  # no locals (nor that line)
    assert "svc:pw@" not in trace and "could not reach <url>" in trace
    assert "The above exception was the direct cause of the following exception" in trace
    assert trace.index("ConnectionError") < trace.index("RuntimeError: ledger unavailable")


def test_a_validation_error_keeps_its_locations_not_the_payload() -> None:
    class Order(BaseModel):
        card: int

    exc = _caught(Order.model_validate, {"card": "4111-1111-1111-1111"})
    failure = failures.classify(exc, 500)
    assert "4111" not in failure.message and "4111" not in (failure.trace or "")
    assert "card:" in failure.message


def test_a_long_trace_keeps_its_start_and_its_end_within_the_limit() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise ValueError("x" * 5000 + " the end")
        deep(n - 1)

    text = traces.format_trace(_caught(deep, 200), 2000, failures.message_of)
    assert len(text) <= 2000
    assert text.startswith("Traceback (most recent call last):")
    assert text.endswith(" the end\n") and "characters cut" in text
    assert len(traces._stack(_caught(deep, 200))) == traces.MAX_FRAMES  # the innermost


def test_the_framework_frames_above_the_handler_are_left_out() -> None:
    # A framework module that calls the handler and catches what it raises, as the
    # processor does: its frame is above the handler's in the traceback.
    runner = Path(failures.__file__).parent / "runner_for_the_test.py"
    namespace: dict[str, object] = {}
    code = "def run(handler):\n    try:\n        handler()\n    except Exception as exc:\n"
    exec(compile(code + "        return exc\n", str(runner), "exec"), namespace)

    def handler() -> None:
        raise KeyError("sku")

    exc = namespace["run"](handler)  # type: ignore[operator]
    trace = traces.format_trace(exc, 10_000, failures.message_of)
    assert "runner_for_the_test.py" not in trace
    assert "in handler" in trace and trace.endswith("KeyError: 'sku'\n")
    assert traces.first_application_frame(exc).endswith("in handler")  # type: ignore[union-attr]


def test_an_installed_application_is_told_from_its_dependencies() -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    shop = f"{site}{os.sep}shop{os.sep}handlers.py"
    lib = f"{site}{os.sep}sqlalchemy{os.sep}engine.py"
    assert traces._installed_root(shop) == f"{site}{os.sep}shop{os.sep}"
    root = traces._installed_root(shop)
    assert traces._application(shop, root) and not traces._application(lib, root)
    assert not traces._application(lib, None)


def test_the_handler_time_travels_with_its_exception() -> None:
    exc = RuntimeError("boom")
    failures.ran_for(exc, 0.25)
    assert failures.classify(exc, 500).seconds == 0.25
    assert failures.classify(RuntimeError("other"), 500).seconds is None
