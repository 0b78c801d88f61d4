"""produce_on_devices: content-addressed work is launched at most once, even across runs queued on a device."""

from contextlib import contextmanager

import tasks.concurrency as concurrency
from tasks.concurrency import produce_on_devices, slot_names


def test_work_is_skipped_when_its_output_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(concurrency, "device_slots", _no_slots)
    done, calls = tmp_path / "result.json", []
    produce_on_devices(done, [0], lambda: (calls.append("first"), done.write_text("{}")))
    produce_on_devices(done, [0], lambda: calls.append("second"))
    assert calls == ["first"]


def test_output_made_by_another_run_while_waiting_is_reused(tmp_path, monkeypatch):
    done, calls = tmp_path / "result.json", []

    @contextmanager
    def other_run_finishes_first(gpu_ids):
        done.write_text("{}")  # the run that held the slot wrote the same content-addressed output
        yield

    monkeypatch.setattr(concurrency, "device_slots", other_run_finishes_first)
    produce_on_devices(done, [0], lambda: calls.append("launched"))
    assert calls == []


def test_slot_names_are_per_device_and_host():
    assert slot_names([2, 0], host="gpu.box") == ["device-gpu-box-gpu2", "device-gpu-box-gpu0"]
    assert slot_names([], host="laptop") == ["device-laptop-cpu"]


@contextmanager
def _no_slots(gpu_ids):
    yield
