"""The environment probe (a child importing torch and bitsandbytes) runs once per interpreter, stack and machine;
later runs reuse its report, with the GPUs' free memory read fresh."""

from __future__ import annotations

import json

from tasks.environment import PROBE_FORMAT, EnvironmentReport, probe_key, run_probe


def test_second_probe_is_reused_and_a_different_stack_probes_again(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = run_probe(tmp_path / "w1", cache=cache)
    assert (tmp_path / "w1" / "environment.job.json").is_file()  # a child ran
    (saved,) = (cache / "environment-probes").iterdir()
    assert EnvironmentReport.model_validate_json(saved.read_text()) == first

    again = run_probe(tmp_path / "w2", cache=cache)
    assert not (tmp_path / "w2").exists()  # no child
    assert again == first

    # another kernels config (and so another stack version or GPU set) is another key: probed anew
    monkeypatch.setattr("tasks.environment._version", lambda dist: "0.0.0-other")
    assert probe_key(None, []) != saved.stem
    run_probe(tmp_path / "w3", cache=cache)
    assert (tmp_path / "w3" / "environment.job.json").is_file()
    assert len(list((cache / "environment-probes").iterdir())) == 2


def test_an_unreadable_cached_probe_is_replaced(tmp_path):
    cache = tmp_path / "cache"
    path = cache / "environment-probes" / f"{probe_key(None, [])}.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"python": "3.11", "truncated')
    report = run_probe(tmp_path / "w", cache=cache)
    assert (tmp_path / "w" / "environment.job.json").is_file()
    assert json.loads(path.read_text())["torch"] == report.torch and PROBE_FORMAT >= 1
