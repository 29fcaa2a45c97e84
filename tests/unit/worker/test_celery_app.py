from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from contracts.dispatch import RUN_PHASE_TASK, worker_queue
from runtime.broker import broker_options
from worker.settings import WorkerSettings, get_settings


@pytest.fixture
def tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """worker.process.tasks imported with settings from a private TRAINCTL_HOME."""
    monkeypatch.setenv("TRAINCTL_HOME", str(tmp_path))
    monkeypatch.setenv("TRAINCTL_QUEUE", "gpu-a100")
    get_settings.cache_clear()
    for name in ("worker.process.tasks", "worker.process.celery_app"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module("worker.process.tasks")
    get_settings.cache_clear()


def test_the_app_is_configured_for_long_tasks_that_may_die(
    tasks: ModuleType, tmp_path: Path
) -> None:
    conf = tasks.app.conf
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    assert conf.task_default_queue == "gpu-a100"
    assert conf.broker_url == broker_options(f"filesystem://{tmp_path / 'broker'}")[0]
    options = conf.broker_transport_options
    assert options["visibility_timeout"] >= 6 * 3600
    assert options["data_folder_in"] == str(tmp_path / "broker" / "queue")
    assert RUN_PHASE_TASK in tasks.app.tasks


def test_the_task_runs_the_attempt_with_the_app_settings(
    tasks: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(
        tasks, "run_attempt", lambda attempt_id, **kw: calls.append((attempt_id, kw))
    )
    tasks.app.tasks[RUN_PHASE_TASK].run("attempt-9")
    ((attempt_id, kwargs),) = calls
    assert attempt_id == "attempt-9"
    assert kwargs["settings"] is tasks.app.settings
    assert kwargs["stop_requested"]() is False


def test_start_worker_runs_one_solo_process_on_the_queue(
    tasks: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    celery_app = sys.modules["worker.process.celery_app"]
    argv: list[list[str]] = []
    monkeypatch.setattr(celery_app.app, "worker_main", argv.append)
    settings = WorkerSettings(home=tmp_path, queue="cpu", broker_url="redis://broker:6379/0")
    celery_app.start_worker(settings, ["--loglevel=INFO"])
    # Its own queue first (where the service places attempts on it), then the base queue.
    own = worker_queue("cpu", celery_app.own_key())
    assert own.startswith("cpu.worker.")
    queues = f"{own},cpu"
    assert argv == [["worker", "--pool=solo", "--concurrency=1", "-Q", queues, "--loglevel=INFO"]]
    assert celery_app.app.conf.broker_url == "redis://broker:6379/0"
    assert celery_app.app.settings is settings


def test_a_warm_shutdown_asks_the_running_phase_to_stop(
    tasks: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.signals import worker_shutting_down

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(tasks, "run_attempt", lambda attempt_id, **kw: calls.append(kw))
    tasks.app.tasks[RUN_PHASE_TASK].run("attempt-9")
    (kwargs,) = calls
    assert kwargs["stop_requested"]() is False
    # What Celery sends on SIGTERM (a spot instance's preemption notice).
    worker_shutting_down.send(sender="worker@host", sig="SIGTERM", how="Warm", exitcode=0)
    assert kwargs["stop_requested"]() is True


def test_a_worker_shutting_down_hands_new_messages_back(
    tasks: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.exceptions import Reject
    from celery.signals import worker_shutting_down

    calls: list[str] = []
    monkeypatch.setattr(tasks, "run_attempt", lambda attempt_id, **kw: calls.append(attempt_id))
    worker_shutting_down.send(sender="test", sig="SIGTERM", how="Warm", exitcode=0)
    with pytest.raises(Reject) as rejected:
        tasks.app.tasks[RUN_PHASE_TASK].run("attempt-10")
    assert rejected.value.requeue is True
    assert calls == [], "nothing was claimed"
