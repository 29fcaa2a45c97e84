"""How the database thins a metric series (service.reads.series.thin_series answers with it):
its first and last point, and between them the points whose step is a multiple of the finest
power-of-two stride that fits the budget, found through ix_metrics_step_level at a cost in the
points returned, not in the points stored. On Postgres each read is a fixed statement,
prepared once per connection; on SQLite one SQLAlchemy builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import CTE, ColumnElement, String, literal, select, text, union_all
from sqlalchemy.orm import Session, aliased

from service.models import EvalResult, MetricPoint


def series_names(model: type[MetricPoint | EvalResult], run_id: str) -> CTE:
    """The names the run has rows of in `model`'s table (column `name`, then a NULL row to
    skip), by a skip scan of its primary key (run_id, name, step): one index seek per name,
    however many rows each has, where DISTINCT would read them all."""
    after = aliased(model)
    names = select(
        select(model.name)
        .where(model.run_id == run_id)
        .order_by(model.name)
        .limit(1)
        .scalar_subquery()
        .label("name")
    ).cte(f"{model.__tablename__}_names", recursive=True)
    return names.union_all(
        select(
            select(after.name)
            .where(after.run_id == run_id, after.name > names.c.name)
            .order_by(after.name)
            .limit(1)
            .scalar_subquery()
        ).where(names.c.name.is_not(None))
    )


def step_level() -> ColumnElement[int]:
    """The largest power of two dividing a point's step (its lowest set bit; 0 for step 0).
    ix_metrics_step_level is on this very expression: both databases use an expression index
    only for the expression as it was indexed."""
    return MetricPoint.step.op("&")(-MetricPoint.step)


Point = tuple[int, float | None]
# Points as two aligned columns, steps and values: a few lists, not a tuple per point.
Columns = tuple[list[int], list[float | None]]
# The same points as two JSON arrays written by Postgres (series.metric_series_json): never
# parsed.
JsonColumns = tuple[str, str]


@dataclass
class _Found:
    """What one read of a series at its level found: `count` rows (at most budget + 3, the
    first and the last point may be among them), `inside` of them strictly between its first
    and last point, and those inside points by step (`kept`)."""

    count: int
    inside: int
    kept: Columns | JsonColumns


@dataclass
class _Series:
    """One series being thinned: its first and last point, and the search for the finest
    stride (2^level) whose multiples between them fit the budget. Whether they fit only
    changes once along the levels (coarser strides keep fewer points)."""

    first: Point
    last: Point
    level: int = 0  # the level to read next
    fitted: int | None = None  # the finest level known to fit, whose points are `kept`
    overflowed: int | None = None  # the coarsest level known not to fit
    kept: Columns | JsonColumns | None = None

    def read(self, found: _Found, budget: int) -> bool:
        """Take what a read at `level` found; True when another read is due."""
        if found.count == budget + 3 or found.inside > budget:
            self.overflowed = self.level
            if self.fitted is None:
                self.level += 1
                return True
        else:
            self.fitted = self.level
            self.kept = found.kept
            if 2 * found.inside > budget:
                # Half the stride would about double the points: it would not fit (exactly so
                # for a series with a point at every step), so no read is spent on it.
                return False
            if self.overflowed is None:
                # Sparse for its span: all of it may fit, which one read of the budget tells.
                self.level = 0
                return self.fitted > 0
        if self.fitted is None or self.overflowed is None:
            return False
        self.level = (self.fitted + self.overflowed) // 2
        return self.level != self.overflowed


def ends(s: _Series, max_points: int) -> tuple[list[Point], list[Point]]:
    """The points of `s` answered before and after its kept interior ones: the last only for
    max_points=1, the one point of a series of one step, else its first and its last."""
    if max_points == 1:
        return [], [s.last]
    if s.first[0] == s.last[0]:
        return [], [s.first]
    return [s.first], [s.last]


def thin(
    *, session: Session, run_id: str, names: list[str] | None, max_points: int, as_json: bool
) -> dict[str, _Series]:
    """The series of `series.thin_series`, by name, each with the interior points it keeps (as
    JSON arrays written by Postgres with `as_json`)."""
    series = _series_bounds(session=session, run_id=run_id, names=names)
    budget = max_points - 2  # interior points, between the first and the last
    if budget > 0:
        for s in series.values():
            s.level = _first_level(s.first[0], s.last[0], budget)
        pending = {name: s for name, s in series.items() if s.last[0] - s.first[0] > 1}
        while pending:
            found = _level_points(
                session=session, run_id=run_id, series=pending, budget=budget, as_json=as_json
            )
            pending = {name: s for name, s in pending.items() if s.read(found[name], budget)}
    return dict(sorted(series.items()))


def _first_level(first: int, last: int, budget: int) -> int:
    """The finest level whose stride has at most `budget` multiples strictly between the
    steps."""
    level = 0
    while ((last - 1) >> level) - (first >> level) > budget:
        level += 1
    return level


def _series_bounds(*, session: Session, run_id: str, names: list[str] | None) -> dict[str, _Series]:
    """The first and last point of each series of the run (of `names` only, when given) that
    has points, in one statement of index seeks: the names come from a skip scan of the
    primary key (one seek per name), not from reading the run's rows."""
    if session.get_bind().dialect.name == "postgresql":
        statement = _PG_BOUNDS_OF_NAMES if names else _PG_BOUNDS
        params: dict[str, Any] = {"run_id": run_id, **({"names": names} if names else {})}
        rows: Any = session.execute(statement, params)
    else:
        rows = session.execute(_bounds_statement(run_id, names))
    return {
        name: _Series(first=(lo, lo_value), last=(hi, hi_value))
        for name, lo, lo_value, hi, hi_value in rows
        if lo is not None
    }


# What _bounds_statement builds, as fixed text for Postgres: one statement whatever the
# names, which psycopg prepares once per connection. Built by SQLAlchemy per read, the
# statements of a thinned read cost more Python than Postgres took to run them.
_PG_EDGES = (
    "SELECT n.name, f.step, f.value, l.step, l.value FROM {names} "
    "CROSS JOIN LATERAL (SELECT step, value FROM metrics "
    "WHERE run_id = :run_id AND name = n.name ORDER BY step LIMIT 1) AS f "
    "CROSS JOIN LATERAL (SELECT step, value FROM metrics "
    "WHERE run_id = :run_id AND name = n.name ORDER BY step DESC LIMIT 1) AS l"
)
_PG_BOUNDS = text(
    "WITH RECURSIVE names(name) AS ("
    "(SELECT name FROM metrics WHERE run_id = :run_id ORDER BY name LIMIT 1) "
    "UNION ALL SELECT (SELECT m.name FROM metrics AS m "
    "WHERE m.run_id = :run_id AND m.name > names.name ORDER BY m.name LIMIT 1) "
    "FROM names WHERE names.name IS NOT NULL) "
    + _PG_EDGES.format(names="names AS n")
    + " WHERE n.name IS NOT NULL"
)
_PG_BOUNDS_OF_NAMES = text(_PG_EDGES.format(names="unnest(CAST(:names AS varchar[])) AS n(name)"))


def _bounds_statement(run_id: str, names: list[str] | None) -> Any:
    if names:
        wanted = union_all(*(select(literal(name, String).label("name")) for name in names))
        source = wanted.cte("wanted")
    else:
        source = series_names(MetricPoint, run_id)

    def edge(column: Any, order: Any) -> Any:
        return (
            select(column)
            .where(MetricPoint.run_id == run_id, MetricPoint.name == source.c.name)
            .order_by(order)
            .limit(1)
            .scalar_subquery()
        )

    first, last = MetricPoint.step.asc(), MetricPoint.step.desc()
    return select(
        source.c.name,
        edge(MetricPoint.step, first),
        edge(MetricPoint.value, first),
        edge(MetricPoint.step, last),
        edge(MetricPoint.value, last),
    ).where(source.c.name.is_not(None))


def _level_points(
    *, session: Session, run_id: str, series: dict[str, _Series], budget: int, as_json: bool
) -> dict[str, _Found]:
    """Per series, up to budget + 3 of its points whose step is a multiple of its level's
    stride: one index range each, all in one statement. The range is not narrowed to the
    steps between the first and the last point: with that second range on the step, SQLite
    chose the primary key and walked the whole series.

    Postgres answers each series as one row: the count of the rows read, and the points
    between the first and the last as two arrays by step (with `as_json`, two JSON arrays as
    text, non-finite values as null, which Python passes on without parsing). As a row per
    point (7,830 for ten series), each read left thousands of objects for Python's collector,
    whose full passes over the service's heap then cost ~55 ms every fourth or fifth read."""
    if session.get_bind().dialect.name == "postgresql":
        items = list(series.items())
        rows = session.execute(
            _PG_LEVEL_JSON if as_json else _PG_LEVEL_ARRAYS,
            {
                "run_id": run_id,
                "limit": budget + 3,
                "names": [name for name, _ in items],
                # The least step level read: 2^level, or 0 (every step, step 0 included).
                "levels": [1 << s.level if s.level > 0 else 0 for _, s in items],
                "firsts": [s.first[0] for _, s in items],
                "lasts": [s.last[0] for _, s in items],
            },
        ).all()
        # The arrays are NULL when no point is inside.
        empty: Any = "[]" if as_json else []
        return {
            name: _Found(count=count, inside=inside, kept=(steps or empty, values or empty))
            for name, count, inside, steps, values in rows
        }
    parts = []
    for name, s in series.items():
        query = select(MetricPoint.step, MetricPoint.value).where(
            MetricPoint.run_id == run_id, MetricPoint.name == name
        )
        if s.level > 0:
            query = query.where(step_level() >= 1 << s.level)
        # SQLite takes a LIMIT in a compound statement only inside a subquery.
        limited = query.limit(budget + 3).subquery()
        parts.append(select(literal(name, String).label("name"), limited.c.step, limited.c.value))
    read: dict[str, list[Point]] = {name: [] for name in series}
    # .all(): fetched in one call, where iterating fetched row by row.
    for name, step, value in session.execute(union_all(*parts)).all():
        read[name].append((step, value))
    found = {}
    for name, points in read.items():
        first, last = series[name].first[0], series[name].last[0]
        kept = sorted(p for p in points if first < p[0] < last)
        found[name] = _Found(
            count=len(points),
            inside=len(kept),
            kept=([p[0] for p in kept], [p[1] for p in kept]),
        )
    return found


# _level_points on Postgres: one fixed statement (prepared once per connection by psycopg)
# for any number of series, each a LIMITed range of ix_metrics_step_level, parameterized by
# the series' row of the arrays. `{steps}` and `{values}` wrap the aggregates of the points
# inside, by step.
_PG_LEVEL = (
    "SELECT w.name, r.count, r.inside, r.steps, r.values "
    "FROM unnest(CAST(:names AS varchar[]), CAST(:levels AS integer[]), "
    "CAST(:firsts AS integer[]), CAST(:lasts AS integer[])) AS w(name, level, first, last) "
    "CROSS JOIN LATERAL (SELECT count(*) AS count, "
    "count(*) FILTER (WHERE p.step > w.first AND p.step < w.last) AS inside, "
    "{steps} AS steps, {values} AS values "
    "FROM (SELECT step, value FROM metrics "
    "WHERE run_id = :run_id AND name = w.name AND (step & (- step)) >= w.level "
    "LIMIT :limit) AS p) AS r"
)
_INSIDE = "{}(array_agg({} ORDER BY p.step) FILTER (WHERE p.step > w.first AND p.step < w.last))"
_PG_LEVEL_ARRAYS = text(
    _PG_LEVEL.format(steps=_INSIDE.format("", "p.step"), values=_INSIDE.format("", "p.value"))
)
# As JSON text: float8 as Postgres prints it (shortest exact, PG >= 12), non-finite as null.
_PG_LEVEL_JSON = text(
    _PG_LEVEL.format(
        steps="CAST(" + _INSIDE.format("array_to_json", "p.step") + " AS text)",
        values="CAST("
        + _INSIDE.format("array_to_json", "CASE WHEN abs(p.value) < 'Infinity' THEN p.value END")
        + " AS text)",
    )
)
