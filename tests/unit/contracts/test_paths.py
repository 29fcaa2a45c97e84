"""The confinement rule (contracts.paths): a path is read only when it resolves inside a data
root; links and `..` are followed before the check, and a directory's links are checked too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from contracts.bounds import EMPTY_PATH
from contracts.paths import DataRoots, split_roots


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """tmp_path/{data, shared, outside, artifacts/runs}, with a file in each."""
    for folder in ("data", "shared", "outside", "artifacts/runs/r1"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "file.jsonl").write_text("{}\n")
    return tmp_path


def test_split_roots_uses_the_os_path_separator_and_ignores_blanks() -> None:
    value = f" /srv/a {os.pathsep}{os.pathsep}/srv/b{os.pathsep}"
    assert split_roots(value) == ["/srv/a", "/srv/b"]


def test_a_path_inside_any_root_is_allowed(tree: Path) -> None:
    roots = DataRoots.of([tree / "data", tree / "shared"])
    assert roots.refusal(str(tree / "data" / "file.jsonl")) is None
    assert roots.refusal(str(tree / "shared" / "file.jsonl")) is None
    assert roots.refusal(str(tree / "data")) is None  # the root itself
    assert roots.refusal(str(tree / "data" / "not-yet.jsonl")) is None  # existence is not this


def test_a_path_outside_every_root_is_refused_naming_the_path_and_the_roots(tree: Path) -> None:
    roots = DataRoots.of([tree / "data", tree / "shared"])
    why = roots.refusal("/etc/passwd")
    assert why is not None
    assert "/etc/passwd is outside the data roots" in why
    assert f"{tree / 'data'}, {tree / 'shared'}" in why
    # A sibling whose name starts like a root is not inside it.
    (tree / "data-other").mkdir()
    assert roots.refusal(str(tree / "data-other" / "x")) is not None


def test_dot_dot_is_resolved_before_the_check(tree: Path) -> None:
    roots = DataRoots.of([tree / "data"])
    why = roots.refusal(f"{tree / 'data'}/../outside/file.jsonl")
    assert why is not None and "outside the data roots" in why
    assert roots.refusal(f"{tree / 'data'}/../../../../../etc/shadow") is not None
    # `..` that stays inside is fine.
    assert roots.refusal(f"{tree / 'data'}/sub/../file.jsonl") is None


def test_a_link_inside_a_root_pointing_out_is_refused_naming_its_target(tree: Path) -> None:
    roots = DataRoots.of([tree / "data"])
    (tree / "data" / "escape.jsonl").symlink_to(tree / "outside" / "file.jsonl")
    (tree / "data" / "passwd").symlink_to("/etc/passwd")
    (tree / "data" / "dir").symlink_to(tree / "outside")
    for name in ("escape.jsonl", "passwd", "dir/file.jsonl"):
        why = roots.refusal(str(tree / "data" / name))
        assert why is not None, name
        assert "resolves to" in why and "outside the data roots" in why, why
    # A link that stays inside the roots is followed and allowed.
    (tree / "data" / "alias.jsonl").symlink_to(tree / "data" / "file.jsonl")
    assert roots.refusal(str(tree / "data" / "alias.jsonl")) is None


def test_a_path_outside_is_not_told_where_it_resolves(tree: Path) -> None:
    """Of a path outside the roots nothing but its name is told: no link target."""
    (tree / "outside" / "link").symlink_to("/etc/hostname")
    why = DataRoots.of([tree / "data"]).refusal(str(tree / "outside" / "link"))
    assert why is not None and "resolves" not in why and "/etc/hostname" not in why


def test_a_directory_holding_a_link_out_is_refused(tree: Path) -> None:
    roots = DataRoots.of([tree / "data"])
    model = tree / "data" / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert roots.refusal(str(model)) is None
    (model / "sub").mkdir()
    (model / "sub" / "model.safetensors").symlink_to(tree / "outside" / "file.jsonl")
    why = roots.refusal(str(model))
    assert why is not None and "holds sub/model.safetensors, a link to" in why, why


def test_the_roots_themselves_are_resolved(tree: Path) -> None:
    """A root given through a link confines to its target; a path through the link is in."""
    (tree / "via").symlink_to(tree / "data")
    roots = DataRoots.of([tree / "via"])
    assert roots.roots == ((tree / "data").resolve(),)
    assert roots.refusal(str(tree / "via" / "file.jsonl")) is None
    assert roots.refusal(str(tree / "data" / "file.jsonl")) is None


def test_checkpoints_may_also_lie_in_the_artifact_stores_runs(tree: Path) -> None:
    roots = DataRoots.of([tree / "data"], artifact_root=tree / "artifacts")
    run_file = str(tree / "artifacts" / "runs" / "r1" / "file.jsonl")
    assert roots.refusal(run_file, "checkpoint") is None
    why = roots.refusal(run_file, "data")
    assert why is not None and "outside the data roots" in why
    # Only runs/: not the token stores or anything else of the artifact store.
    (tree / "artifacts" / "tokens").mkdir()
    assert roots.refusal(str(tree / "artifacts" / "tokens"), "checkpoint") is not None


def test_a_path_in_a_run_s_folder_is_found_as_that_run_links_and_dot_dot_followed(
    tree: Path,
) -> None:
    roots = DataRoots.of([tree / "data"], artifact_root=tree / "artifacts")
    runs = tree / "artifacts" / "runs"
    step = runs / "r1" / "checkpoints" / "step-00000004"
    assert roots.in_runs(str(step)) == ("r1", ("checkpoints", "step-00000004"))
    assert roots.in_runs(f"{step}/") == ("r1", ("checkpoints", "step-00000004"))
    assert roots.in_runs(str(runs / "r1")) == ("r1", ())
    # Through a link in a data root, and through `..` out of another run's folder.
    (tree / "data" / "borrowed").symlink_to(runs / "r1")
    assert roots.in_runs(str(tree / "data" / "borrowed" / "file.jsonl")) == ("r1", ("file.jsonl",))
    assert roots.in_runs(f"{runs}/r2/../r1/file.jsonl") == ("r1", ("file.jsonl",))
    # Not a run: runs/ itself, the rest of the store, elsewhere, a path the OS cannot use.
    for path in (runs, tree / "artifacts" / "tokens", tree / "data" / "file.jsonl"):
        assert roots.in_runs(str(path)) is None
    assert roots.in_runs(f"{runs}/r1/a\0b") is None
    assert DataRoots.of([tree / "data"]).in_runs(str(step)) is None  # no artifact store known


def test_unusable_paths_are_refused_not_raised(tree: Path) -> None:
    roots = DataRoots.of([tree / "data"])
    assert "NUL byte" in (roots.refusal(f"{tree / 'data'}/a\0b") or "")
    assert "is relative" in (roots.refusal("relative/file.jsonl") or "")
    assert roots.refusal(str(tree / "data" / ("x" * 5000))) is not None


def test_no_roots_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="TRAINCTL_DATA_ROOTS"):
        DataRoots.of([])


def test_an_empty_path_is_refused_as_empty_not_as_relative(tree: Path) -> None:
    roots = DataRoots.of([tree / "data"])
    assert roots.refusal("") == EMPTY_PATH
    assert "not an absolute path" not in (roots.refusal("file.jsonl") or "")


def test_object_store_prefixes_are_roots() -> None:
    from contracts.paths import split_roots

    assert split_roots("/srv/data:s3://bucket/data:/srv/more") == [
        "/srv/data",
        "s3://bucket/data",
        "/srv/more",
    ]
    roots = DataRoots.of(["s3://bucket/data/"], artifact_root="s3://bucket/artifacts")
    assert roots.refusal("s3://bucket/data/corpus.jsonl") is None
    assert roots.refusal("s3://bucket/data/sub/tok.json") is None
    refused = roots.refusal("s3://bucket/database/x")  # a prefix of the name is not a root
    assert refused is not None and "s3://bucket/data/" in refused
    assert roots.refusal("s3://bucket/data/../secret/x") is not None
    assert roots.refusal("s3://bucket/artifacts/runs/r1/checkpoints/step-00000005") is not None
    run_checkpoint = "s3://bucket/artifacts/runs/r1/checkpoints/step-00000005"
    assert roots.refusal(run_checkpoint, "checkpoint") is None
    assert roots.in_runs(run_checkpoint) == ("r1", ("checkpoints", "step-00000005"))
    assert roots.in_runs("s3://bucket/data/x") is None
    assert roots.refusal("/srv/local/file") is not None  # no local root given
