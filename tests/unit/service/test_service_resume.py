"""Pure pieces of resuming: the mismatch message, which attempts count as active, and how an
initial checkpoint taken from another run is signed."""

from __future__ import annotations

from datetime import timedelta

from contracts.signature import Digests, FieldDiff, compute_signature
from contracts.workflow import validate_workflow
from service.models import Attempt, utcnow
from service.runs.initial_checkpoint import InitialCheckpoint, sign_run
from service.runs.resume import signature_mismatch
from service.workers.lease import is_active, lease_expired

DOC = {
    "name": "w",
    "model": {"config": {"vocab_size": 10}},
    "tokenizer": "/t/tok.json",
    "microbatch_tokens": 8,
    "phases": [
        {
            "name": "p",
            "objective": "continued_pretrain",
            "data": [{"path": "/d/a.jsonl"}],
            "sequence_length": 4,
            "microbatch_size": 2,
            "steps": 3,
        }
    ],
}
DIGESTS = Digests(tokenizer="t" * 64, data={"/d/a.jsonl": "a" * 64}, initial_checkpoint="c" * 64)


def test_mismatch_names_every_field_with_both_values() -> None:
    error = signature_mismatch(
        run_id="run_1",
        differences=[
            FieldDiff(field="initial_checkpoint.sha256", stored="3f2a", given="9c1b"),
            FieldDiff(field="phases[2].steps", stored=4, given=7),
            FieldDiff(field="pretrained.sha256", stored=None, given="77aa"),
        ],
    )
    assert (error.status, error.code) == (409, "signature_mismatch")
    assert error.message.startswith(
        "signature mismatch: initial_checkpoint.sha256 stored 3f2a given 9c1b; "
        "phases[2].steps stored 4 given 7; pretrained.sha256 stored null given 77aa; "
    )
    assert "run_1" in error.message
    assert error.details["differences"][1] == {
        "field": "phases[2].steps",
        "stored": 4,
        "given": 7,
    }


def test_an_attempt_is_active_while_queued_or_running_under_a_live_lease() -> None:
    now = utcnow()
    live = Attempt(status="running", lease_expires_at=now + timedelta(seconds=1))
    expired = Attempt(status="running", lease_expires_at=now - timedelta(seconds=1))
    assert is_active(Attempt(status="queued"), now)
    assert is_active(live, now) and not lease_expired(live, now)
    assert not is_active(expired, now) and lease_expired(expired, now)
    for status in ("failed", "preempted", "lost", "succeeded", "superseded"):
        ended = Attempt(status=status, lease_expires_at=now - timedelta(seconds=1))
        assert not is_active(ended, now)
        assert not lease_expired(ended, now)


def test_the_source_run_and_step_of_an_initial_checkpoint_are_stored_not_signed() -> None:
    spec = validate_workflow(DOC)
    plain = compute_signature(workflow=spec, digests=DIGESTS, initial_checkpoint="/ck")
    taken = sign_run(
        workflow=spec,
        digests=DIGESTS,
        initial=InitialCheckpoint(path="/art/run_a/step-5", run="run_a", step=5),
    )
    assert taken.sha256 == plain.sha256
    assert taken.components["initial_checkpoint"] == {
        "path": "/art/run_a/step-5",
        "sha256": "c" * 64,
        "run": "run_a",
        "step": 5,
    }
    assert InitialCheckpoint.from_components(taken.components) == InitialCheckpoint(
        path="/art/run_a/step-5", run="run_a", step=5
    )
    assert InitialCheckpoint.from_components(plain.components) == InitialCheckpoint(path="/ck")
