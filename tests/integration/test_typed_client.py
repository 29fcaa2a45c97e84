"""The Python client (client/) against a live stack: the README's example, run as written, and
the typed answers the CLI prints with --json, which must be the API's answers unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from procs import ROOT, Stack, processes, short_demo_workflow

from client import ApiError, Client

pytestmark = pytest.mark.integration


def readme_example() -> str:
    """The README's Python example: the code block that uses the client."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    (example,) = [b for b in blocks if "from client import Client" in b]
    return example


def test_the_readme_example_creates_a_run_waits_and_prints_its_eval_table(
    tmp_path: Path,
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    workflow = short_demo_workflow(pretrain_steps=4, sft_steps=2)
    # The example's file, where it names it, holding a workflow a few steps long.
    (tmp_path / "examples" / "workflows").mkdir(parents=True)
    (tmp_path / "examples" / "workflows" / "demo.json").write_text(json.dumps(workflow))
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        stack.worker()
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("TRAINCTL_API_URL", stack.url)
        monkeypatch.setenv("TRAINCTL_TOKEN", stack.admin)
        exec(compile(readme_example(), "README.md", "exec"), {})
        printed = capsys.readouterr().out.splitlines()

        with Client.from_env() as api, stack.api() as raw:
            (run,) = api.list_runs().runs
            assert run.status == "succeeded"
            # What `--json` prints (the model written back) is what the API answered.
            for model, path in [
                (api.get_run(run.id), f"/runs/{run.id}"),
                (api.list_runs(), "/runs"),
                (api.eval_by_phase(run.id), f"/runs/{run.id}/eval/phases"),
                (api.ledger(run.id), f"/runs/{run.id}/ledger"),
                (api.checkpoints(run.id), f"/runs/{run.id}/checkpoints"),
                (api.workers(), "/workers"),
                (api.whoami(), "/whoami"),
                (api.tokens(), "/tokens"),
            ]:
                assert model.model_dump(mode="json") == raw.get(path).json(), path
            answer = raw.get(f"/runs/{run.id}/eval").json()
            assert api.eval(run.id).model_dump(mode="json") == answer

            events = list(api.events(run.id))
            assert events[0].name == "run" and events[0].data["id"] == run.id
            assert events[-1].name == "end" and events[-1].data == {"status": "succeeded"}
            metrics = api.download_metrics_csv(run.id, tmp_path / "metrics.csv", names=["loss"])
            assert metrics.read_text().splitlines()[0] == "run_id,name,step,value"
            assert len(metrics.read_text().splitlines()) == 1 + run.total_steps
            evals = api.download_eval_csv(run.id, tmp_path / "evals.csv")
            assert evals.read_text().startswith("run_id,name,task,step,phase,")

            with pytest.raises(ApiError) as missing:
                api.get_run("run_doesnotexist")
            assert (missing.value.status, missing.value.code) == (404, "run_not_found")
            assert "run_doesnotexist" in missing.value.message

    # A line per eval set: its name, then baseline and final perplexity.
    sets = [e.get("name") or e["task"] for e in workflow["evals"]]
    rows = [line.split() for line in printed]
    assert sorted(row[0] for row in rows) == sorted(sets)
    assert all(len(row) == 3 and float(row[1]) > 0 and float(row[2]) > 0 for row in rows), printed


def test_an_unreachable_service_is_an_api_error_with_status_0() -> None:
    with Client("http://127.0.0.1:9", "token") as api, pytest.raises(ApiError) as err:
        api.whoami()
    assert (err.value.status, err.value.code) == (0, "unreachable")
    assert isinstance(err.value.__cause__, httpx.TransportError)
