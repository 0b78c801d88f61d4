"""The plots in the Prefect UI, as a person sees them: a real `prefect server`, a real CLI run against it, and
headless Chromium asked (through the DevTools protocol) whether each plot's <img> decoded to a picture.

Screenshots land in test-outputs/ (docs/images/run-page-plots.png in the README is one of them).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import child_env, tiny_overrides
from deploy_support import ROOT, PrefectStack, chromium_eval

pytestmark = pytest.mark.slow

OUTPUTS = ROOT / "test-outputs"
PLOT_KEYS = ("loss-curve", "eval-comparison")
IMAGES = """[...document.images].filter(i => i.src.startsWith('data:image/png')).map(i => (
    {alt: i.alt, width: i.naturalWidth, height: i.naturalHeight, complete: i.complete,
     shown: i.getBoundingClientRect().width}))"""


def images_ready(n: int) -> str:
    return f"({IMAGES}).filter(i => i.complete && i.width > 0).length >= {n}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui-stack")
    s = PrefectStack(home=tmp / "home", logs=tmp / "logs")
    try:
        s.start_server()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def cli_run(stack, shared_cache, tmp_path_factory):
    """`python flows/finetune.py` against the server, as a person runs it with PREFECT_API_URL set."""
    from prefect.client.schemas.sorting import FlowRunSort

    runs = tmp_path_factory.mktemp("runs")
    argv = [sys.executable, "flows/finetune.py"]
    for override in tiny_overrides(shared_cache / "ui", runs, **{"export.merge": True}):
        argv += ["--set", override]
    done = subprocess.run(argv, cwd=ROOT, env=child_env(stack.env), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with stack.client() as client:
        (run,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
    return run


def test_plot_artifacts_embed_pngs(stack, cli_run):
    artifacts = stack.artifacts_of(str(cli_run.id))
    for key in PLOT_KEYS:
        assert artifacts[key].type == "markdown"
        assert "](data:image/png;base64,iVBORw0KGgo" in artifacts[key].data  # the PNG signature, base64-encoded


@pytest.mark.parametrize("key", PLOT_KEYS)
def test_artifact_page_renders_the_plot(stack, cli_run, key, tmp_path):
    artifact = stack.artifacts_of(str(cli_run.id))[key]
    OUTPUTS.mkdir(exist_ok=True)
    images = chromium_eval(f"{stack.url}/v2/artifacts/artifact/{artifact.id}", tmp_path / "profile", IMAGES,
                           images_ready(1), screenshot=OUTPUTS / f"prefect-ui-{key}.png")
    (image,) = images
    assert image["complete"] and image["width"] > 300 and image["height"] > 150, image  # decoded, not broken
    assert image["shown"] > 100, image  # and laid out on the page


def test_run_page_links_the_plots(stack, cli_run, tmp_path):
    """Prefect 3.9's run page lists artifacts as cards (content renders on each artifact's page)."""
    OUTPUTS.mkdir(exist_ok=True)
    text = chromium_eval(f"{stack.url}/v2/runs/flow-run/{cli_run.id}?tab=Artifacts", tmp_path / "profile",
                         "document.body.innerText", "document.body && document.body.innerText.includes('loss-curve')",
                         window="1400,1600", screenshot=OUTPUTS / "prefect-ui-run-artifacts.png")
    assert all(key in text for key in (*PLOT_KEYS, "run-summary", "eval-vs-previous", "merged-model")), text


def test_run_summary_page_shows_both_plots(stack, cli_run, tmp_path):
    """The run's summary, the first artifact a person opens: the eval table, then both plots."""
    summary = stack.artifacts_of(str(cli_run.id))["run-summary"]
    OUTPUTS.mkdir(exist_ok=True)
    shot = OUTPUTS / "prefect-ui-run-summary-plots.png"
    images = chromium_eval(f"{stack.url}/v2/artifacts/artifact/{summary.id}", tmp_path / "profile", IMAGES,
                           images_ready(2), window="1400,1900", screenshot=shot)
    assert [i["alt"] for i in images] == ["Loss curve", "Base vs base + adapter"], images
    assert all(i["complete"] and i["width"] > 300 and i["height"] > 150 and i["shown"] > 100 for i in images), images
    assert shot.stat().st_size > 50_000
