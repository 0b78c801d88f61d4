"""A real Prefect stack for the deployment tests: server, `make deploy`, `make worker`, runs, logs, Chromium.

Everything runs as the README says (the make targets, `prefect deployment run`), against a server on a free
127.0.0.1 port with its own PREFECT_HOME, and is torn down (every process this module started) at the end.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

from finetune_flows.config.parameters import config_parameter
from finetune_flows.runtime.lifecycle import preexec_die_with
from finetune_flows.runtime.processes import alive, descendants

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
WORKER_HEARTBEAT_SECONDS = 5
PREFECT = str(VENV_BIN / "prefect")
STAMP = ".venv/.installed"  # `make -o` it: the suite runs inside `make test`, after setup
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def demo_config(overrides: list[str]) -> dict[str, Any]:
    """The on-demand deployment's config (configs/demo.yaml) with `key=value` overrides, as the JSON a run's
    `config` parameter carries (what `python flows/finetune.py --set ... --print-params` prints)."""
    return config_parameter(ROOT / "configs" / "demo.yaml", overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether the server at `url` answers GET `<url>/health` (Prefect's and MLflow's liveness endpoint)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2):
            return True
    except OSError:  # refused, timed out, or an HTTP error status
        return False


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, what: str, timeout: float = 120) -> None:
    """Wait until the server `proc` started answers at `url`; fail with its log's tail if it exits or `timeout`
    passes first."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not healthy after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Terminate a process started with start_new_session=True, its group, and everything it spawned."""
    pids = [proc.pid, *descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for send, target in ((os.killpg, proc.pid), *((os.kill, pid) for pid in pids)):
            try:
                send(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.2)
        if not any(alive(pid) for pid in pids):
            break
    proc.wait(timeout=grace)


class PrefectStack:
    """A Prefect server on 127.0.0.1:<free port> with its own home, and a worker for the deployments' pool.

    The worker runs under its own policy file (finetune_flows/runtime/policy.py): the safe defaults, with `allow` (a
    dict of policy fields) added, so a test lets its runs use its temporary directories and nothing touches $HOME.
    `extra_env` is added to the environment of the server and the worker, so of every run's processes too.
    """

    def __init__(self, home: Path, logs: Path, allow: dict[str, Any] | None = None,
                 extra_env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.url}/api"
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PREFECT_") and k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        env.update(
            PREFECT_HOME=str(home), PREFECT_API_URL=self.api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false",
            # Runs are triggered by the tests; the nightly schedule must not start a demo-sized run meanwhile.
            PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
            # A queued run re-polls a busy device limit at most this often (server default: 30 s).
            PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS="5",
            PREFECT_WORKER_QUERY_SECONDS="2", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
            # The worker re-reads its pool at each heartbeat (default: every 30 s); a test that changes the pool
            # waits for one.
            PREFECT_WORKER_HEARTBEAT_SECONDS=str(WORKER_HEARTBEAT_SECONDS),
            # as `make server` sets it: device-slot leases survive a server restart
            PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE="prefect.server.concurrency.lease_storage.filesystem",
            PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        env.update(extra_env or {})
        self.policy = str(self.write_policy(logs.parent / "worker-policy.yaml", allow or {}))  # for `make worker`
        self.env = env
        self.procs: list[subprocess.Popen] = []

    @staticmethod
    def write_policy(path: Path, allow: dict[str, Any]) -> Path:
        from finetune_flows.runtime.policy import Policy

        policy = Policy.safe_defaults(ROOT)
        for key, value in allow.items():
            current = getattr(policy, key)
            setattr(policy, key, current + list(value) if isinstance(current, list) else value)
        path.write_text(policy.to_yaml())
        return path

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        """Start a process of the stack in a session of its own, ended (SIGTERM) when this process dies, a SIGKILLed
        pytest too."""
        out = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=preexec_die_with(os.getpid()))
        self.procs.append(proc)
        return proc

    def start_server(self, timeout: float = 120, log: str = "server") -> None:
        proc = self._spawn([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)], log)
        wait_healthy(self.api_url, proc, self.logs / f"{log}.log", "prefect server", timeout)

    def restart_server(self, down_seconds: float) -> None:
        """Stop the server, leave it down for a while, start it again on the same port and database."""
        server = self.procs.pop(0)  # the first process started
        stop(server)
        time.sleep(down_seconds)
        self.start_server(log=f"server-{len(self.procs)}")
        self.procs.insert(0, self.procs.pop())  # close() still stops the server last

    def make(self, *targets: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.run(["make", "-o", STAMP, *targets], timeout=timeout)

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                 f"{result.stderr[-3000:]}")
        return result

    def post(self, path: str, body: dict[str, Any]):
        """POST to the server's API as Prefect's own client does it: a 503 (its SQLite database was busy) is retried."""
        import httpx

        for attempt in range(10):
            reply = httpx.post(f"{self.api_url}{path}", timeout=30, json=body)
            if reply.status_code != 503:
                break
            time.sleep(1 + attempt)
        return reply

    def start_worker(self) -> None:
        self._spawn(["make", "-o", STAMP, "worker", f"FINETUNE_FLOWS_POLICY={self.policy}"], "worker")

    def deployment_run(self, name: str, job_variables: dict[str, Any] | None = None, **params: Any) -> str:
        """`prefect deployment run NAME --param k=<json> [--job-variable k=<json>]`; returns the new flow run's id."""
        argv = [PREFECT, "deployment", "run", name]
        for key, value in params.items():
            argv += ["--param", f"{key}={json.dumps(value)}"]
        for key, value in (job_variables or {}).items():
            argv += ["--job-variable", f"{key}={json.dumps(value)}"]
        out = self.run(argv).stdout
        match = re.search(r"UUID: ([0-9a-f-]{36})", out)
        assert match, f"no flow run id in the output of {' '.join(argv)}:\n{out}"
        return match.group(1)

    @contextmanager
    def client(self) -> Iterator[Any]:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}), get_client(sync_client=True) as client:
            yield client

    def wait_for(self, flow_run_ids: list[str], timeout: float) -> dict[str, Any]:
        """Poll until every flow run is terminal; return {id: flow run}."""
        from uuid import UUID

        deadline = time.monotonic() + timeout
        with self.client() as client:
            while True:
                runs = {i: client.read_flow_run(UUID(i)) for i in flow_run_ids}
                if all(r.state and r.state.type.value in TERMINAL for r in runs.values()):
                    return runs
                if time.monotonic() > deadline:
                    states = {i: r.state.type.value if r.state else None for i, r in runs.items()}
                    raise TimeoutError(f"flow runs not finished after {timeout} s: {states}\n"
                                       f"worker log:\n{(self.logs / 'worker.log').read_text()[-4000:]}")
                time.sleep(2)

    def logs_of(self, flow_run_id: str) -> list[Any]:
        from uuid import UUID

        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        logs: list[Any] = []
        with self.client() as client:
            while True:
                page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)])),
                                        limit=200, offset=len(logs))
                logs += page
                if len(page) < 200:
                    return logs

    def artifacts_of(self, flow_run_id: str) -> dict[str, Any]:
        """{key: artifact} of a flow run (the latest of each key)."""
        from uuid import UUID

        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with self.client() as client:
            found = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)])))
        return {a.key: a for a in sorted(found, key=lambda a: a.created)}

    @contextmanager
    def deployed(self) -> Iterator["PrefectStack"]:
        """The server up, `make deploy` done and `make worker` running for the block; everything stopped after."""
        try:
            self.start_server()
            self.make("deploy")
            self.start_worker()
            yield self
        finally:
            self.close()

    def close(self) -> None:
        for proc in reversed(self.procs):  # the worker first, then the server
            stop(proc)


@contextmanager
def running_stack(tmp: Path, deploy: bool = True, allow: dict[str, Any] | None = None,
                  extra_env: dict[str, str] | None = None) -> Iterator[PrefectStack]:
    """A server with its own home under tmp and, with deploy, `make deploy` and `make worker` (under a worker
    policy that allows `allow`; `extra_env` in their environment); all stopped after."""
    stack = PrefectStack(home=tmp / "home", logs=tmp / "logs", allow=allow, extra_env=extra_env)
    try:
        stack.start_server()
        if deploy:
            stack.make("deploy")
            stack.start_worker()
        yield stack
    finally:
        stack.close()


# ---------------------------------------------------------------- the UI in headless Chromium

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--virtual-time-budget=20000"]


def chromium(url: str, profile: Path, *mode: str, window: str = "1400,1000", timeout: float = 90) -> str:
    """Load url in headless Chromium (fresh profile) with `--dump-dom` or `--screenshot=PATH`; return stdout."""
    if shutil.which("chromium") is None:
        raise AssertionError("chromium is not installed: `make test-deps` installs Debian's package")
    profile.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--window-size={window}", f"--user-data-dir={profile}",
                             *mode, url], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"chromium exited {result.returncode} on {url}:\n{result.stderr[-2000:]}")
    return result.stdout


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))).strip()


def table_rows(dom: str) -> list[list[str]]:
    """The rendered <table> rows of a page, as the text of their cells."""
    rows = []
    for row in re.findall(r"<tr\b.*?</tr>", dom, flags=re.S):
        cells = [visible_text(c) for c in re.findall(r"<t[dh]\b.*?</t[dh]>", row, flags=re.S)]
        if cells:
            rows.append(cells)
    return rows


def chromium_eval(url: str, profile: Path, expression: str, ready: str, window: str = "1400,1000",
                  timeout: float = 120, screenshot: Path | None = None, interact: Any = None) -> Any:
    """Open url in headless Chromium and evaluate a JavaScript expression in the page once `ready` (another
    expression) is true, through the DevTools protocol; optionally save a screenshot of the page at that moment.
    `interact(page)`, when given, runs in between with page.evaluate(js), page.click(x, y), page.wait(js) and
    page.screenshot() (PNG bytes).

    For what only the live page knows (an <img> that decoded has naturalWidth > 0), which `--dump-dom` cannot show.
    """
    import base64

    from websockets.sync.client import connect

    if shutil.which("chromium") is None:
        raise AssertionError("chromium is not installed: `make test-deps` installs Debian's package")
    profile.mkdir(parents=True, exist_ok=True)
    port_file = profile / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)  # a reused profile keeps the port of its last browser
    flags = [f for f in CHROMIUM_FLAGS if not f.startswith("--virtual-time-budget")]
    proc = subprocess.Popen(["chromium", *flags, f"--window-size={window}", f"--user-data-dir={profile}",
                             "--remote-debugging-port=0", "about:blank"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not port_file.is_file() or not port_file.read_text().strip():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"chromium did not open its DevTools port (exit {proc.poll()})")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=2**26, open_timeout=30) as ws:
            ids = iter(range(1, 10**6))

            def call(method: str, **params: Any) -> dict:
                msg_id = next(ids)
                ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
                while True:
                    reply = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 1)))
                    if reply.get("id") == msg_id:
                        if "error" in reply:
                            raise AssertionError(f"{method}: {reply['error']}")
                        return reply["result"]

            def evaluate(js: str) -> Any:
                result = call("Runtime.evaluate", expression=js, returnByValue=True, awaitPromise=True)
                if "exceptionDetails" in result:
                    raise AssertionError(f"{js}: {result['exceptionDetails']}")
                return result["result"].get("value")

            width, height = (int(v) for v in window.split(","))
            call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
            call("Page.navigate", url=url)
            settled = 0  # React pages re-render after data arrives: ready must hold on three polls in a row
            while settled < 3:
                settled = settled + 1 if evaluate(f"Boolean({ready})") else 0
                if time.monotonic() > deadline:
                    raise AssertionError(f"page {url} never became ready ({ready}); text: "
                                         f"{str(evaluate('document.body && document.body.innerText'))[:2000]}")
                time.sleep(0.5)
            if interact is not None:
                def click(x: float, y: float) -> None:
                    for kind in ("mousePressed", "mouseReleased"):
                        call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

                def wait(js: str) -> None:
                    while not evaluate(f"Boolean({js})"):
                        if time.monotonic() > deadline:
                            raise AssertionError(f"never true on {url}: {js}")
                        time.sleep(0.5)

                def capture() -> bytes:
                    return base64.b64decode(call("Page.captureScreenshot", format="png")["data"])

                interact(SimpleNamespace(evaluate=evaluate, click=click, wait=wait, screenshot=capture))
            value = evaluate(expression)
            if screenshot is not None:
                shot = call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            return value
    finally:
        stop(proc)
