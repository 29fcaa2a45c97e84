"""`GET /runs/{id}/events`: a run's live progress as server-sent events.

Each event has a name and one JSON object as its `data:`:

- `run`: the run as `GET /runs/{id}` answers it. Sent first, then whenever it changes (status,
  phase, step, attempts, latest checkpoint); a change of heartbeat times alone is not sent.
- `metrics`: new training metric points as columns, the shape `GET /runs/{id}/metrics` answers:
  `{"series": {"loss": {"steps": [...], "values": [...]}, ...}}`.
- `evals`: new evaluation results, `{"points": [{"name", "task", "step", "phase",
  "cross_entropy", "perplexity", "records", "target_tokens", "oversized_records",
  "skipped_records"}, ...]}`,
  one per eval set (`name`, default its task) and step.
- `rewind`: `{"step", "attempt"}`: an attempt resumed from `step`, and the service dropped the
  run's metric points and evaluations after it (they come again as that attempt reports them).
- `end`: `{"status"}`, after the final `run`, `metrics` and `evals` of a finished run; then the
  stream closes. A client that reconnects to a finished run gets its final state and `end` again.
- `error`: `{"message"}` when the database stopped answering; the stream closes and the client
  reconnects with the steps it has. Also when the stream's token was revoked (or rotated): the
  stream re-checks it every TOKEN_CHECK_SECONDS and closes, and a reconnect is 401.

A comment line (`: ping - <time>`) every HEARTBEAT_SECONDS keeps proxies from closing an idle
stream. `metrics_after` and `evals_after` skip the steps a client already read with
`GET /runs/{id}/metrics` and `/eval` (default: everything, from step 0, in batches).

The stream polls the database (POLL_SECONDS) for rows after the steps it sent, per metric name and
per eval set, in short sessions: an open stream holds no database connection between polls. Auth is
the bearer header, as for every read; the dashboard reads the stream with fetch() so that the
token never appears in a URL (EventSource cannot send headers).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request
from sqlalchemy import select, union_all
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sse_starlette import EventSourceResponse, ServerSentEvent

from contracts.bounds import MAX_COUNT
from service import access
from service.api.deps import Credentials, MetricNamesDep, authenticate
from service.auth import find_token
from service.errors import is_retryable
from service.lifecycle import FINISHED_RUN, phase_start
from service.models import Attempt, Checkpoint, EvalResult, MetricPoint, Run
from service.reads.evaluation import EVAL_COLUMNS, eval_point
from service.reads.series import json_float
from service.reads.thinning import series_names
from service.runs.run import get_run, run_for
from service.runs.view import run_public

log = logging.getLogger(__name__)

router = APIRouter(tags=["runs"])

POLL_SECONDS = 1.0
# How often an open stream looks its token up again (one indexed read, in the session of a
# poll): a revoked token streams for at most this long, and a poll a second pays no extra query.
TOKEN_CHECK_SECONDS = 5.0
HEARTBEAT_SECONDS = 15.0
# Rows per `metrics` or `evals` event: a client that starts from step 0 gets the history in
# batches, one right after the other, instead of one event of every point the run has.
MAX_ROWS_PER_EVENT = 5000
# What workers report every step (worker/train/loop.py); `names` asks for others.
DEFAULT_METRICS = ("loss", "lr", "lr_muon", "grad_norm", "tokens_per_s")
# Fields of a run that change with every heartbeat; a change of these alone is not an event.
_HEARTBEAT_FIELDS = ("updated_at", "recovery_seconds")

Event = tuple[str, dict[str, Any]]


def _progress(run: dict[str, Any]) -> dict[str, Any]:
    """A run's public view without what every heartbeat changes."""
    kept = {k: v for k, v in run.items() if k not in _HEARTBEAT_FIELDS}
    kept["attempts"] = [
        {k: v for k, v in a.items() if k != "heartbeat_at"} for a in run["attempts"]
    ]
    return kept


@dataclass
class StepCursor:
    """The last step sent per key (metric name or eval set name); keys not seen yet start at
    `after`. Keys are unique per step in both tables, so "after the last step sent" is exact."""

    after: int
    sent: dict[str, int] = field(default_factory=dict)

    def last(self, key: str) -> int:
        return self.sent.get(key, self.after)

    def advance(self, key: str, step: int) -> None:
        self.sent[key] = max(step, self.last(key))

    def rewind(self, step: int) -> None:
        """Forget what was sent after `step` (the service deleted it)."""
        self.after = min(self.after, step)
        self.sent = {key: min(last, step) for key, last in self.sent.items()}

    def highest(self) -> int:
        return max([self.after, *self.sent.values()])


@dataclass
class Poll:
    events: list[Event]
    # The stream ends after these events: the run is finished and everything it reported has
    # been sent, or the token was refused.
    finished: bool
    more: bool  # a batch was full: poll again at once


@dataclass
class RunEvents:
    """What one stream has sent of one run; `poll` reads what changed since and advances."""

    run_id: str
    names: Sequence[str]
    metrics: StepCursor
    evals: StepCursor
    # What `waiting_for_worker` is judged by (the service's settings).
    lease_seconds: float
    queue: str
    claimed: set[str] | None = None  # attempts seen claimed; None before the first poll
    progress: dict[str, Any] | None = None

    def poll(self, session: Session) -> Poll:
        # The run first, the rows after: once it reads finished, the rows read next include
        # everything it reported (reports after the finish are refused).
        run = get_run(session=session, run_id=self.run_id)
        events: list[Event] = []
        public = run_public(
            session=session, run=run, lease_seconds=self.lease_seconds, queue=self.queue
        ).model_dump(mode="json")
        progress = _progress(public)
        if progress != self.progress:
            self.progress = progress
            events.append(("run", public))
        events.extend(self._rewinds(session, run))
        metrics, more_metrics = self._metrics(session)
        evals, more_evals = self._evals(session)
        events += [*metrics, *evals]
        more = more_metrics or more_evals
        finished = run.status in FINISHED_RUN and not more
        if finished:
            events.append(("end", {"status": run.status}))
        return Poll(events=events, finished=finished, more=more)

    def _rewinds(self, session: Session, run: Run) -> list[Event]:
        """A newly claimed attempt deleted the points after the step it starts from."""
        claims = session.execute(
            select(Attempt.id, Attempt.number, Attempt.phase_index, Attempt.resume_checkpoint_id)
            .where(Attempt.run_id == run.id, Attempt.claimed_at.is_not(None))
            .order_by(Attempt.number)
        ).all()
        if self.claimed is None:
            self.claimed = {claim.id for claim in claims}
            return []
        events: list[Event] = []
        for claim in claims:
            if claim.id in self.claimed:
                continue
            self.claimed.add(claim.id)
            resumed = (
                None
                if claim.resume_checkpoint_id is None
                else session.get(Checkpoint, claim.resume_checkpoint_id)
            )
            start = resumed.step if resumed is not None else phase_start(run, claim.phase_index)
            if start < max(self.metrics.highest(), self.evals.highest()):
                self.metrics.rewind(start)
                self.evals.rewind(start)
                events.append(("rewind", {"step": start, "attempt": claim.number}))
        return events

    def _metrics(self, session: Session) -> tuple[list[Event], bool]:
        # One limited index range per name (the primary key is run, name, step), each in a
        # subquery of its own: as one OR of the names' conditions, Postgres walked the run's
        # rows in key order and filtered out every row below the cursors (350,000 of them for
        # one batch 350,000 points into a catch-up), so each poll cost what the run stored.
        ranges = [
            select(
                select(MetricPoint.name, MetricPoint.step, MetricPoint.value)
                .where(
                    MetricPoint.run_id == self.run_id,
                    MetricPoint.name == name,
                    MetricPoint.step > self.metrics.last(name),
                )
                .order_by(MetricPoint.step)
                .limit(MAX_ROWS_PER_EVENT)
                .subquery()
            )
            for name in dict.fromkeys(self.names)
        ]
        batch = union_all(*ranges).subquery()
        rows = session.execute(
            select(batch).order_by(batch.c.name, batch.c.step).limit(MAX_ROWS_PER_EVENT)
        ).all()
        if not rows:
            return [], False
        series: dict[str, dict[str, list[Any]]] = {}
        for name, step, value in rows:
            column = series.setdefault(name, {"steps": [], "values": []})
            column["steps"].append(step)
            column["values"].append(json_float(value))
            self.metrics.advance(name, step)
        return [("metrics", {"series": series})], len(rows) == MAX_ROWS_PER_EVENT

    def _evals(self, session: Session) -> tuple[list[Event], bool]:
        # Per eval set, the rows after its cursor, as for metrics; the sets are found by a
        # skip scan (a set may appear at any step). One filter over the run's rows read every
        # evaluation the run had at every poll.
        found = series_names(EvalResult, self.run_id)
        names = session.scalars(select(found.c.name).where(found.c.name.is_not(None))).all()
        if not names:
            return [], False
        ranges = [
            select(
                select(*EVAL_COLUMNS)
                .where(
                    EvalResult.run_id == self.run_id,
                    EvalResult.name == name,
                    EvalResult.step > self.evals.last(name),
                )
                .order_by(EvalResult.step)
                .limit(MAX_ROWS_PER_EVENT)
                .subquery()
            )
            for name in names
        ]
        batch = union_all(*ranges).subquery()
        rows = session.execute(
            select(batch).order_by(batch.c.step, batch.c.name).limit(MAX_ROWS_PER_EVENT)
        ).all()
        if not rows:
            return [], False
        points = [eval_point(row) for row in rows]
        for point in points:
            self.evals.advance(point["name"], point["step"])
        return [("evals", {"points": points})], len(rows) == MAX_ROWS_PER_EVENT


@dataclass
class TokenCheck:
    """Whether the bearer token a stream was opened with still authenticates (a revoked or
    rotated one does not, service.auth.find_token), looked up at most every
    TOKEN_CHECK_SECONDS."""

    secret: str = field(repr=False)
    due: float = field(default_factory=lambda: time.monotonic() + TOKEN_CHECK_SECONDS)

    def refused(self, session: Session) -> bool:
        now = time.monotonic()
        if now < self.due:
            return False
        self.due = now + TOKEN_CHECK_SECONDS
        return find_token(session=session, token=self.secret) is None


_TOKEN_REFUSED = (
    "the token this stream was opened with was revoked (or rotated); open it again with a "
    "valid token"
)


def _poll_once(sessions: sessionmaker[Session], stream: RunEvents, token: TokenCheck) -> Poll:
    with sessions() as session:
        if token.refused(session):
            return Poll(events=[("error", {"message": _TOKEN_REFUSED})], finished=True, more=False)
        return stream.poll(session)


def _encode(name: str, data: dict[str, Any]) -> ServerSentEvent:
    # allow_nan=False: values are finite or null already (json_float); anything else is a bug.
    return ServerSentEvent(
        json.dumps(data, separators=(",", ":"), allow_nan=False), event=name, sep="\n"
    )


async def stream_run_events(
    *,
    sessions: sessionmaker[Session],
    stream: RunEvents,
    token: TokenCheck,
    poll_seconds: float = POLL_SECONDS,
) -> AsyncIterator[ServerSentEvent]:
    """The events of `stream`'s run until it is finished, or until `token` is refused.
    Polls in a worker thread (the database calls block); the event loop only sleeps between
    polls."""
    while True:
        try:
            poll = await anyio.to_thread.run_sync(partial(_poll_once, sessions, stream, token))
        except SQLAlchemyError as err:
            if not is_retryable(err):
                raise
            log.warning("events of run %s: database unavailable (%s)", stream.run_id, err)
            message = "the database does not answer; reconnect shortly with the steps you have"
            yield _encode("error", {"message": message})
            return
        for name, data in poll.events:
            yield _encode(name, data)
        if poll.finished:
            return
        if not poll.more:
            await anyio.sleep(poll_seconds)


class EventStream(EventSourceResponse):
    """What the document says `/events` answers: `text/event-stream` only, so that a generated
    client reads the stream as text instead of waiting for the run's end to parse JSON."""

    # None here (the class's default, for the document only): FastAPI then adds no
    # `{"type": "string"}` schema of its own, which schemathesis would hold the whole stream,
    # read as a list of events, to; the `responses` below say what the stream is. Each
    # response still goes out as text/event-stream (sse_starlette's own default).
    media_type = None


@router.get(
    "/runs/{run_id}/events",
    response_class=EventStream,
    responses={
        200: {
            # OpenAPI 3.2's way for a stream: `itemSchema` is one event (its name and its
            # `data:`, one JSON object as text), which schemathesis checks each event against;
            # `schema`, the whole stream, is any text, which a generated client returns as is.
            "content": {
                "text/event-stream": {
                    "schema": {"title": "EventStream", "description": "the whole stream, as text"},
                    "itemSchema": {
                        "type": "object",
                        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                    },
                }
            },
            "description": "server-sent events",
        }
    },
)
def read_events(
    run_id: str,
    request: Request,
    credentials: Credentials,
    names: MetricNamesDep,
    metrics_after: Annotated[
        int, Query(ge=-1, le=MAX_COUNT, description="send metric points after this step only")
    ] = -1,
    evals_after: Annotated[
        int, Query(ge=-1, le=MAX_COUNT, description="send evaluations after this step only")
    ] = -1,
) -> EventStream:
    """Server-sent events of the run's progress until it finishes (see the module docstring
    of service/api/routes/events.py for the events and their data). `names` default: what workers
    report every step (loss, lr, lr_muon, grad_norm, tokens_per_s)."""
    sessions: sessionmaker[Session] = request.app.state.session_factory
    # Authorise and look the run up in a session of its own, closed before the stream starts:
    # a stream that lasts hours must not hold a pooled connection.
    with sessions() as session:
        token = authenticate(session, credentials, request)
        if (refused := access.role_refusal(token, "GET", request.url.path)) is not None:
            raise refused
        run_for(session, token, run_id)
    assert credentials is not None  # authenticate answered 401 without
    stream = RunEvents(
        run_id=run_id,
        names=names or DEFAULT_METRICS,
        metrics=StepCursor(after=metrics_after),
        evals=StepCursor(after=evals_after),
        lease_seconds=request.app.state.settings.lease_seconds,
        queue=request.app.state.settings.queue,
    )
    return EventStream(
        stream_run_events(
            sessions=sessions, stream=stream, token=TokenCheck(secret=credentials.credentials)
        ),
        ping=HEARTBEAT_SECONDS,
        sep="\n",
        # A client that stops reading (a frozen tab) is dropped instead of buffering forever.
        send_timeout=60,
    )
