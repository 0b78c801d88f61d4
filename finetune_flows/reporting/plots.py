"""Did it learn? The loss curve and the base-vs-adapter comparison as PNGs in the run directory and in the UI.

The PNGs land in `<run>/plots/` and are published as markdown artifacts (`loss-curve`, `eval-comparison`) that
embed them as `data:image/png;base64` images: Prefect 3.9's UI renders markdown with a URL transform that keeps
`data:image/...` sources on <img> (its rehype-sanitize schema allows the `data` protocol for `src`), so the
plots show in the run's Artifacts tab without a file server. tests/test_plots_ui.py checks it in Chromium.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from finetune_flows.evaluation.evaluate import EvalReport
from finetune_flows.files import write_atomic
from finetune_flows.training.train import TrainResult

TRAIN_COLOR, BASE_COLOR, ADAPTER_COLOR, MERGED_COLOR = "#1f77b4", "#7f7f7f", "#d62728", "#2ca02c"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: the orchestrator may run on a headless worker
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    write_atomic(path, png.getvalue())
    return path


def plot_loss(train: TrainResult, report: EvalReport | None, path: Path) -> Path:
    """Training loss per logged step; the held-out loss of base (step 0) and base + adapter (last step)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    steps, losses = zip(*train.loss_curve) if train.loss_curve else ((), ())
    ax.plot(steps, losses, color=TRAIN_COLOR, marker="o" if len(steps) < 30 else None, markersize=3,
            label="training loss")
    if report is not None:
        ax.scatter([0], [report.base.loss], color=BASE_COLOR, marker="s", s=40, zorder=3,
                   label=f"held-out loss, base ({report.base.loss:.3f})")
        ax.scatter([train.steps], [report.adapter.loss], color=ADAPTER_COLOR, marker="D", s=40, zorder=3,
                   label=f"held-out loss, base + adapter ({report.adapter.loss:.3f})")
    top = max([*losses, *([report.base.loss, report.adapter.loss] if report else [])], default=1.0)
    if top / max(min([*losses, *([report.adapter.loss] if report else [])], default=1.0), 1e-6) > 30:
        ax.set_yscale("log")  # the base's held-out loss can dwarf the curve
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"Loss: {train.first_loss:.3f} -> {train.final_loss:.3f} in {train.steps} steps "
                 f"({train.tokens_per_second:.0f} tokens/s)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_eval(report: EvalReport, path: Path) -> Path:
    """Base and base + adapter (and a merged checkpoint) side by side: held-out loss, perplexity and the
    generation metric."""
    plt = _pyplot()
    models = report.models()
    labels = [{"base": "base", "adapter": "+ adapter"}.get(key, key) for key, _, _ in models]
    colors = [{"base": BASE_COLOR, "adapter": ADAPTER_COLOR}.get(key, MERGED_COLOR) for key, _, _ in models]
    panels = [("held-out loss", [s.loss for _, _, s in models], "{:.3f}"),
              ("perplexity", [s.perplexity for _, _, s in models], "{:.2f}")]
    if all(s.generation_score is not None for _, _, s in models):
        panels.append((report.metric, [s.generation_score for _, _, s in models], "{:.2f}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(1.3 * len(models) * len(panels) + 0.6, 3.0))
    for ax, (title, values, fmt) in zip(axes, panels):
        bars = ax.bar(labels, values, color=colors, width=0.6)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
        ax.set_title(title, fontsize=10)
        if title == "perplexity" and max(values) / max(min(values), 1e-6) > 30:
            ax.set_yscale("log")
        if title == report.metric:
            ax.set_ylim(0, 1.1)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Held-out evaluation: {report.eval_rows} rows, {report.base.generated} generated "
                 f"({report.attn_implementation}, {report.device})", fontsize=10)
    fig.tight_layout()
    path = _save(fig, path)
    plt.close(fig)
    return path


def image_markdown(title: str, png: Path, caption: str) -> str:
    """Markdown that shows the PNG inline in the Prefect UI (a data: URI, which its renderer keeps for images)."""
    data = base64.b64encode(png.read_bytes()).decode()
    return f"### {title}\n\n![{title}](data:image/png;base64,{data})\n\n{caption}\n"


TITLES = {"loss.png": "Loss curve", "eval.png": "Base vs base + adapter"}


def plots_markdown(pngs: list[Path]) -> str:
    """The plots inline, for the `run-summary` artifact (the page a person opens first)."""
    return "\n".join(image_markdown(TITLES.get(p.name, p.stem), p, f"`{p}`") for p in pngs)


def publish_plots(run_dir: Path, train: TrainResult | None, report: EvalReport) -> list[Path]:
    """Write `<run>/plots/*.png` and publish them as the `loss-curve` and `eval-comparison` artifacts."""
    from prefect.artifacts import create_markdown_artifact

    written = []
    if train is not None:
        loss = plot_loss(train, report, run_dir / "plots" / "loss.png")
        create_markdown_artifact(
            image_markdown(TITLES[loss.name], loss, f"`{loss}`: training loss per logged step; markers: held-out "
                           "loss of the base (step 0) and of base + adapter (last step)."),
            key="loss-curve", description="Training loss per step, held-out loss before and after")
        written.append(loss)
    comparison = plot_eval(report, run_dir / "plots" / "eval.png")
    versus = " vs ".join(name for _, name, _ in report.models())
    create_markdown_artifact(
        image_markdown(TITLES[comparison.name] if report.merged is None else versus.capitalize(), comparison,
                       f"`{comparison}`"),
        key="eval-comparison", description=f"Held-out evaluation: {versus}")
    written.append(comparison)
    return written
