"""The environment probe (a child importing torch and bitsandbytes) runs once per interpreter, stack and machine;
later runs reuse its report (a store entry with a manifest), with the GPUs' free memory read fresh."""

from __future__ import annotations

import json

import pytest

from finetune_flows.runtime.environment import (
    PROBE_DIR_ENV, PROBE_FORMAT, PROBES, EnvironmentReport, probe_key, run_probe,
)
from finetune_flows.store.entries import MANIFEST, Entry


@pytest.fixture(autouse=True)
def probes_in_the_cache(monkeypatch):
    monkeypatch.delenv(PROBE_DIR_ENV, raising=False)  # the default: <cache>/environment-probes


def test_second_probe_is_reused_and_a_different_stack_probes_again(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = run_probe(tmp_path / "w1", cache=cache)
    assert (tmp_path / "w1" / "environment.job.json").is_file()  # a child ran
    (saved,) = (cache / PROBES).iterdir()
    # a store entry: its manifest (kind, key, the report) is the record, verified before it is reused
    manifest = json.loads((saved / MANIFEST).read_text())
    assert (manifest["kind"], manifest["key"], manifest["files"]) == (PROBES, saved.name, {})
    assert EnvironmentReport.model_validate(manifest["result"]) == first
    assert Entry(cache, PROBES, saved.name).problem() is None and (cache / ".locks").is_dir()

    again = run_probe(tmp_path / "w2", cache=cache)
    assert not (tmp_path / "w2").exists()  # no child
    assert again == first

    # another kernels config (and so another stack version or GPU set) is another key: probed anew
    monkeypatch.setattr("finetune_flows.runtime.environment.installed_version", lambda dist: "0.0.0-other")
    assert probe_key(None, []) != saved.name
    run_probe(tmp_path / "w3", cache=cache)
    assert (tmp_path / "w3" / "environment.job.json").is_file()
    assert len(list((cache / PROBES).iterdir())) == 2


def test_an_unreadable_cached_probe_is_replaced(tmp_path):
    cache = tmp_path / "cache"
    path = cache / PROBES / probe_key(None, []) / MANIFEST
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "files": {}, "result": {"python": "3.11", "truncated')
    report = run_probe(tmp_path / "w", cache=cache)
    assert (tmp_path / "w" / "environment.job.json").is_file()
    assert json.loads(path.read_text())["result"]["torch"] == report.torch and PROBE_FORMAT >= 1


def test_one_probe_directory_serves_every_cache_on_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv(PROBE_DIR_ENV, str(tmp_path / "probes"))
    first = run_probe(tmp_path / "w1", cache=tmp_path / "cache-a")
    again = run_probe(tmp_path / "w2", cache=tmp_path / "cache-b")
    assert (tmp_path / "w1" / "environment.job.json").is_file() and not (tmp_path / "w2").exists()
    assert again == first and len(list((tmp_path / "probes" / PROBES).iterdir())) == 1
    assert not (tmp_path / "cache-a").exists() and not (tmp_path / "cache-b").exists()


def test_local_kernels_is_part_of_the_key_when_kernels_are_configured(monkeypatch):
    kernels = {"RMSNorm": "kernels-community/liger_kernels"}
    monkeypatch.setenv("LOCAL_KERNELS", "kernels-community/liger_kernels=/a")
    key = probe_key(kernels, [])
    monkeypatch.setenv("LOCAL_KERNELS", "kernels-community/liger_kernels=/b")
    assert probe_key(kernels, []) != key  # another local copy may load differently: probed anew
    assert probe_key(None, []) == probe_key({}, [])  # without layer kernels LOCAL_KERNELS changes nothing
