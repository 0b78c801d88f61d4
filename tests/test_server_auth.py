"""`make server` with Prefect's API authentication: clients without the auth string are refused, and a server
listening beyond this machine is not started without it."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.deploy_support import PREFECT, ROOT, STAMP, PrefectStack, wait_healthy

pytestmark = pytest.mark.slow

AUTH = "finetune:correct-horse-battery"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth-server")
    stack = PrefectStack(home=tmp / "home", logs=tmp / "logs")
    stack.env["PREFECT_SERVER_API_AUTH_STRING"] = AUTH
    proc = stack._spawn(["make", "-o", STAMP, "server", f"PREFECT_PORT={stack.port}"], "server")
    # /api/health answers without credentials (liveness probes)
    wait_healthy(stack.api_url, proc, tmp / "logs" / "server.log", "make server", timeout=180)
    try:
        yield stack
    finally:
        stack.close()


def cli(stack: PrefectStack, auth: str | None) -> subprocess.CompletedProcess:
    env = dict(stack.env)
    env.pop("PREFECT_SERVER_API_AUTH_STRING")
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth
    return subprocess.run([PREFECT, "work-pool", "ls"], env=env, capture_output=True, text=True, timeout=120)


def test_a_request_without_credentials_is_refused(server):
    request = urllib.request.Request(f"{server.api_url}/flows/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 401 and json.loads(info.value.read()) == {"exception_message": "Unauthorized"}


def test_a_client_needs_the_auth_string(server):
    refused, wrong, allowed = cli(server, None), cli(server, "finetune:wrong"), cli(server, AUTH)
    assert refused.returncode != 0 and "401" in refused.stdout + refused.stderr
    assert wrong.returncode != 0 and "401" in wrong.stdout + wrong.stderr
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def test_make_server_refuses_to_listen_on_the_network_without_auth(tmp_path):
    stack = PrefectStack(home=tmp_path / "home", logs=tmp_path / "logs")
    result = subprocess.run(["make", "-C", str(ROOT), "-o", STAMP, "server", "PREFECT_HOST=0.0.0.0",
                             f"PREFECT_PORT={stack.port}"], env=stack.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "without authentication; set PREFECT_SERVER_API_AUTH_STRING=user:password" in result.stderr
