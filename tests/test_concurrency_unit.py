"""Device slot names (the Prefect side is tested with a real server in tests/test_deployments.py)."""

from finetune_flows.orchestration.concurrency import slot_names


def test_slot_names_are_per_device_and_host():
    assert slot_names([2, 0], host="gpu.box") == ["device-gpu-box-gpu2", "device-gpu-box-gpu0"]
    assert slot_names([], host="laptop") == ["device-laptop-cpu"]
