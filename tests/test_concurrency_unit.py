"""Device slot names (the Prefect side is tested with a real server in tests/test_deployments.py)."""

from finetune_flows.orchestration.concurrency import slot_names


def test_slot_names_are_per_device_and_host():
    assert slot_names([2, 0], host="gpu.box") == ["device-gpu-box-gpu2", "device-gpu-box-gpu0"]
    assert slot_names([], host="laptop") == ["device-laptop-cpu"]


# ---------------------------------------------------------------- the Prefect side, with a client that fakes a server


class FakeServer:
    """A Prefect server's device limits as the client sees them; `renew_status` answers renewals (410: gone)."""

    def __init__(self, renew_status: int | None = None):
        self.active, self.calls, self.renew_status = 0, [], renew_status

    def __call__(self, sync_client=True):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read_global_concurrency_limit_by_name(self, name):
        from types import SimpleNamespace

        return SimpleNamespace(id="lim", limit=1, active_slots=self.active)

    def increment_concurrency_slots_with_lease(self, names, **kw):
        from types import SimpleNamespace

        self.active += 1
        return SimpleNamespace(json=lambda: {"lease_id": "00000000-0000-0000-0000-000000000001"})

    def renew_concurrency_lease(self, lease_id, duration):
        import httpx

        from prefect.exceptions import PrefectHTTPStatusError

        self.calls.append("renew")
        if self.renew_status:
            request = httpx.Request("POST", "http://server/renew")
            raise PrefectHTTPStatusError("gone", request=request, response=httpx.Response(self.renew_status,
                                                                                          request=request))

    def release_concurrency_slots_with_lease(self, lease_id):
        self.calls.append("release lease")  # a lease the server lost: a no-op, the slot stays counted

    def release_concurrency_slots(self, names, slots, occupancy_seconds):
        self.calls.append("release by name")
        self.active -= slots


def test_a_slot_whose_lease_a_restarted_server_lost_is_released_by_name(monkeypatch, tmp_path, caplog):
    import time

    import prefect.client.orchestration

    from finetune_flows.orchestration import concurrency

    server = FakeServer(renew_status=410)  # the server restarted: its leases were in memory, its limits' counts not
    monkeypatch.setattr(prefect.client.orchestration, "get_client", server)
    monkeypatch.setattr(concurrency, "slot_dir", lambda: tmp_path)
    monkeypatch.setattr(concurrency, "LEASE_SECONDS", 0.2)  # renewed every 0.15 s
    caplog.set_level("INFO", logger="finetune_flows")
    with concurrency.device_slots([]):
        assert server.active == 1
        time.sleep(1)
    lost = [r for r in caplog.records if "lost the lease" in r.getMessage()]
    assert server.active == 0, server.calls  # before: the slot stayed taken for every later run, for ever
    assert server.calls.count("renew") == 1 and len(lost) == 1, server.calls  # said once, not every 10 s


def test_a_slot_file_another_user_created_opens_where_o_creat_on_it_is_refused(monkeypatch, tmp_path):
    """fs.protected_regular (systemd's default) refuses an O_CREAT open of another user's file in a sticky
    directory even where it exists and is writable; the host lock was then skipped without a word. Simulated here
    (the tests run as root on a host with the setting off): such an open raises as the kernel would."""
    import os

    from finetune_flows.orchestration import concurrency

    path = tmp_path / "device-host-gpu0.lock"
    path.write_text("")
    real_open = os.open

    def kernel_open(file, flags, *args):
        if flags & os.O_CREAT and not flags & os.O_EXCL and os.path.exists(file):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", kernel_open)
    fd = concurrency._open_slot_file(path, create=True)
    assert fd is not None
    os.close(fd)
    new = concurrency._open_slot_file(tmp_path / "new.lock", create=True)  # a missing file is still created
    assert new is not None and (tmp_path / "new.lock").exists()
    os.close(new)
