"""A phase across machines (worker.process.launch's `Gang`): members of one attempt, each a
worker with its own ranks, meet at a c10d rendezvous (a TCPStore served by global rank 0) and
train as one process group.

On one machine, a member is a process that runs `run_ranks` as the runner does for its part
of the attempt (one gloo rank each, standing for a machine); global rank 0 trains with a
reporter that writes what it heard to a JSON file (test_distributed's). The service's member
protocol is not involved: each member is handed its part directly."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from test_distributed import (
    STEPS,
    FileReporter,
    alone,
    assert_within_float_order,
    mid,
    on_ranks,
    weights,
)
from test_runner import InProcessService

from contracts.reports import Claim, Finish, Heartbeat, Rendezvous
from contracts.workflow import Workflow, WorkflowInvalid, validate_workflow
from worker.link.client import ServiceClient
from worker.link.reporter import SilentReporter
from worker.process.claim import claim_request
from worker.process.launch import Gang, RankFailure, free_port, run_ranks
from worker.process.runner import run_attempt
from worker.settings import WorkerSettings
from worker.train.loop import train_phase
from worker.train.ranks import Ranks


def train_member_rank(device: torch.device, workdir: Path, claim_json: str, out: str) -> None:
    """A rank's work (run_ranks): the phase, over every member's ranks; global rank 0 keeps
    what it reported."""
    torch.set_num_threads(1)
    claim = Claim.model_validate_json(claim_json)
    workflow = Workflow.model_validate(claim.workflow)
    rank = dist.get_rank()
    reporter = FileReporter() if rank == 0 else SilentReporter()
    outcome = train_phase(
        claim=claim,
        workflow=workflow,
        reporter=reporter,
        device=device,
        ranks=Ranks(rank=rank, world=dist.get_world_size(), device=device),
    )
    if isinstance(reporter, FileReporter):
        assert outcome.checkpoint is not None
        result = {
            "losses": reporter.losses,
            "checkpoints": reporter.checkpoints,
            "final": outcome.checkpoint.path,
        }
        Path(out).write_text(json.dumps(result))


def beat_forever(device: torch.device, workdir: Path) -> None:
    """A rank's work: all-reduce, every 0.1 s, until a peer goes."""
    (workdir / f"up-{dist.get_rank()}").touch()
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)


def _member(
    work: Callable[..., object], args: tuple[object, ...], gang: Gang, workdir: str, out: str
) -> None:
    """One member of an attempt: its ranks (run_ranks, as the runner starts them), and how
    they ended, written to `out`."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    _, failure = run_ranks(
        work,
        1,
        args,
        workdir=Path(workdir),
        stop_requested=lambda: False,
        handed_over=lambda: None,
        gang=gang,
    )
    Path(out).write_text(json.dumps(None if failure is None else failure.__dict__))


def start_members(
    work: Callable[..., object],
    args: tuple[object, ...],
    nodes: int,
    tmp_path: Path,
    *,
    only: list[int] | None = None,
) -> list[tuple[multiprocessing.process.BaseProcess, Path]]:
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    members = []
    for k in only if only is not None else range(nodes):
        out = tmp_path / f"member-{k}.json"
        process = spawn.Process(
            target=_member,
            args=(work, args, Gang(nodes, k, "127.0.0.1", port), str(tmp_path / f"m{k}"), out),
        )
        process.start()
        members.append((process, out))
    return members


def ended(member: tuple[multiprocessing.process.BaseProcess, Path], within: float) -> Any:
    process, out = member
    process.join(within)
    assert not process.is_alive(), f"member still running after {within} s"
    return json.loads(out.read_text())


@pytest.fixture
def gang_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the rank processes (worker.settings); short, so that the failures come fast.
    monkeypatch.setenv("TRAINCTL_DEVICE", "cpu")
    monkeypatch.setenv("TRAINCTL_COLLECTIVE_TIMEOUT_SECONDS", "30")
    monkeypatch.setenv("TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS", "4")


def test_nodes_is_a_resource_left_out_when_one_and_grad_accum_divides_over_every_rank(
    make_workflow: Callable[..., Workflow], make_text_file: Callable[..., Path]
) -> None:
    def phase(grad_accum: int, resources: dict[str, int]) -> dict[str, Any]:
        return {
            "name": "p",
            "objective": "continued_pretrain",
            "data": [make_text_file()],
            "steps": 2,
            "grad_accum": grad_accum,
            "resources": resources,
        }

    gang = make_workflow([phase(4, {"nodes": 2, "devices": 2})])
    assert gang.phase_nodes(0) == 2
    assert gang.normalized()["phases"][0]["resources"] == {"nodes": 2, "devices": 2}
    # One node is today's form: stored, and signed, as before.
    one = make_workflow([phase(4, {"nodes": 1, "devices": 2})])
    assert one.normalized()["phases"][0]["resources"] == {"devices": 2}
    doc = gang.normalized()
    doc["phases"][0]["grad_accum"] = 2
    with pytest.raises(WorkflowInvalid) as refused:
        validate_workflow(doc)
    [problem] = refused.value.problems
    assert problem.path == "phases[0].grad_accum"
    assert "2 nodes x 2 devices" in problem.message and "multiple of 4" in problem.message


def test_a_claim_across_nodes_names_its_rendezvous_and_one_node_s_messages_stay_as_they_were(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
) -> None:
    claim = make_claim(
        make_workflow(
            [
                {
                    "name": "p",
                    "objective": "continued_pretrain",
                    "data": [make_text_file()],
                    "steps": 2,
                }
            ]
        )
    )
    assert (claim.nodes, claim.node_rank, claim.rendezvous) == (1, 0, None)
    fields = claim.model_dump()
    with pytest.raises(ValueError, match="needs a rendezvous"):
        Claim.model_validate({**fields, "nodes": 2, "node_rank": 1})
    with pytest.raises(ValueError, match="node_rank 2 is not one of 2 nodes"):
        Claim.model_validate(
            {**fields, "nodes": 2, "node_rank": 2, "rendezvous": {"host": "h", "port": 1}}
        )
    member = Claim.model_validate(
        {**fields, "nodes": 2, "node_rank": 1, "rendezvous": {"host": "h", "port": 29400}}
    )
    assert member.rendezvous == Rendezvous(host="h", port=29400)
    assert "member" not in Heartbeat(fencing_token="t", step=1).model_dump(mode="json")
    assert Heartbeat(fencing_token="t", step=1, member=1).model_dump(mode="json")["member"] == 1
    assert "member" not in Finish(fencing_token="t", status="failed", step=1).model_dump()
    assert "member" not in claim_request(None).model_dump(mode="json")


def test_a_phase_on_two_members_trains_what_two_ranks_and_one_device_train(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
    gang_settings: None,
) -> None:
    workflow = make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": STEPS,
                "grad_accum": 2,
                "resources": {"nodes": 2, "devices": 1},
            }
        ],
        checkpoint={"every_steps": 3, "keep_last": 5},
    )
    claim = make_claim(workflow, artifact_dir=tmp_path / "gang")
    members = start_members(
        train_member_rank, (claim.model_dump_json(), str(tmp_path / "gang.json")), 2, tmp_path
    )
    assert [ended(m, 300) for m in members] == [None, None]
    gang = json.loads((tmp_path / "gang.json").read_text())
    gang["losses"] = {int(k): v for k, v in gang["losses"].items()}

    # Two members of one rank each are the same world as two ranks on one worker: bit for bit.
    local = on_ranks(make_claim(workflow, artifact_dir=tmp_path / "two"), 2, tmp_path / "two.json")
    assert sorted(gang["losses"]) == list(range(1, STEPS + 1))
    assert gang["losses"] == local["losses"]
    a, b = weights(local), weights(gang)
    assert all(torch.equal(a[name], b[name]) for name in a)
    # And one device's math, to float-reduction order.
    one = alone(make_claim(workflow, artifact_dir=tmp_path / "one"))
    for step in range(1, STEPS + 1):
        assert math.isclose(gang["losses"][step], one["losses"][step], rel_tol=1e-5), step
    c = weights(one)
    for name in c:
        assert_within_float_order(b[name], c[name], workflow.optimizer.muon_lr, name)
    # Rank 0 (member 0) alone checkpointed; its checkpoint resumes on one device.
    assert [ck["step"] for ck in gang["checkpoints"]] == [3, 6]
    fewer = alone(make_claim(workflow, artifact_dir=tmp_path / "fewer", resume_from=mid(gang, 3)))
    assert all(math.isclose(fewer["losses"][s], gang["losses"][s], rel_tol=1e-5) for s in (4, 5))


def test_a_member_killed_mid_phase_fails_the_other_promptly_naming_it(
    tmp_path: Path, gang_settings: None
) -> None:
    first, second = start_members(beat_forever, (), 2, tmp_path)
    deadline = time.monotonic() + 120
    while not ((tmp_path / "m0" / "up-0").exists() and (tmp_path / "m1" / "up-1").exists()):
        assert time.monotonic() < deadline, "the members never joined"
        time.sleep(0.1)
    time.sleep(0.5)
    killed = time.monotonic()
    os.kill(second[0].pid, signal.SIGKILL)  # its rank dies with it (PR_SET_PDEATHSIG)
    failure = RankFailure(**ended(first, 60))
    # Well within the collective timeout (30 s): gloo sees the connection close.
    assert time.monotonic() - killed < 20
    assert failure.rank == 0 and failure.cause == "infrastructure"
    assert failure.message.startswith("rank 0 of 2 failed: GangError: lost member 1 of 2"), (
        failure.message
    )


def test_a_member_that_never_comes_fails_the_other_after_the_rendezvous_timeout(
    tmp_path: Path, gang_settings: None
) -> None:
    started = time.monotonic()
    [first] = start_members(beat_forever, (), 2, tmp_path, only=[0])
    failure = RankFailure(**ended(first, 60))
    assert time.monotonic() - started >= 4  # TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS
    assert failure.message.startswith("rank 0 of 2 failed: GangError: member(s) 1 of 2 did not "), (
        failure.message
    )
    assert "TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS" in failure.message
    # And a member whose rendezvous host never comes gives up too, naming it.
    [last] = start_members(beat_forever, (), 2, tmp_path / "b", only=[1])
    failure = RankFailure(**ended(last, 60))
    assert failure.rank == 1
    assert "could not reach the rendezvous at 127.0.0.1:" in failure.message, failure.message


@pytest.fixture
def member_settings(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> WorkerSettings:
    # The parent's settings (the ranks read theirs from the environment: gang_settings).
    return WorkerSettings(
        home=tmp_path / "home",
        device="cpu",
        devices="1",
        heartbeat_seconds=0.05,
        spool_flush_seconds=0,
        data_roots=(tmp_path_factory.getbasetemp(),),
    )


def member_claim(claim: Claim, node_rank: int) -> Claim:
    return claim.model_copy(
        update={
            "nodes": 2,
            "node_rank": node_rank,
            "rendezvous": Rendezvous(host="127.0.0.1", port=free_port()),
        }
    )


def as_member(service: InProcessService, settings: WorkerSettings, member: int) -> Any:
    client = ServiceClient(
        "http://service", "token", transport=httpx.MockTransport(service), backoff_seconds=0
    )
    return run_attempt("attempt-1", settings=settings, client=client, member=member)


@pytest.fixture
def phase(make_workflow: Callable[..., Workflow], make_text_file: Callable[..., Path]) -> Workflow:
    return make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": 2,
                "grad_accum": 2,
                "resources": {"nodes": 2},
            }
        ]
    )


def test_a_member_whose_rendezvous_never_answers_beats_as_itself_and_finishes_failed_as_itself(
    phase: Workflow,
    make_claim: Callable[..., Claim],
    member_settings: WorkerSettings,
    gang_settings: None,
) -> None:
    service = InProcessService(member_claim(make_claim(phase), 1))
    assert as_member(service, member_settings, 1) is None
    [claimed] = service.of("claim")
    assert claimed["member"] == 1
    assert service.keeper_beats and all(b["member"] == 1 for b in service.keeper_beats)
    [finish] = service.of("finish")
    assert (finish["status"], finish["member"], finish["cause"]) == (
        "failed",
        1,
        "infrastructure",
    )
    assert finish["message"].startswith("rank 1 of 2 failed: GangError: rank 1 of 2 (member 1")
    assert "could not reach the rendezvous" in finish["message"]


def test_a_member_told_to_stop_ends_its_ranks_and_writes_nothing(
    phase: Workflow,
    make_claim: Callable[..., Claim],
    member_settings: WorkerSettings,
    gang_settings: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS", "120")
    service = InProcessService(member_claim(make_claim(phase), 1), stop_after_heartbeats=0)
    started = time.monotonic()
    assert as_member(service, member_settings, 1) is None
    assert time.monotonic() - started < 60  # not the rendezvous timeout
    assert service.of("finish") == []
