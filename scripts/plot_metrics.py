"""Draw a run's metrics.jsonl as one PNG: training loss, eval loss, learning rate and tokens/s, for runs
without W&B.

    python scripts/plot_metrics.py outputs/tiny                    # writes outputs/tiny/metrics.png
    python scripts/plot_metrics.py outputs/tiny --output plot.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardtune.checks.command_line import OneLineParser

# (metrics.jsonl key, panel title); a panel whose key no row holds says so instead of drawing nothing silently.
PANELS = (("loss", "training loss"), ("eval_loss", "eval loss"), ("lr", "learning rate"),
          ("tokens_per_second", "tokens/s (all ranks)"))


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a line cut short by a killed run (the last one) is left out."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[key]) for row in rows if key in row]
    return [step for step, _ in points], [value for _, value in points]


def plot(rows: list[dict], output: Path, title: str = "") -> None:
    """Four panels against the optimizer step, written as a PNG (matplotlib's Agg backend: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for axis, (key, name) in zip(axes.flat, PANELS, strict=True):
        steps, values = series(rows, key)
        if steps:
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        else:
            axis.text(0.5, 0.5, f"no {key} in metrics.jsonl", ha="center", va="center", transform=axis.transAxes)
        axis.set_title(name)
        axis.grid(alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("step")
    axes[0][1].sharey(axes[0][0])  # the two losses on one scale, so that the gap between them reads directly
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="a run's output directory (holding metrics.jsonl)")
    parser.add_argument("--output", type=Path, help="the PNG to write; default: output_dir/metrics.png")
    args = parser.parse_or_exit(argv)
    metrics = args.output_dir / "metrics.jsonl"
    if not metrics.is_file():
        print(f"plot_metrics: error: {metrics} does not exist; give a run's output_dir.", file=sys.stderr)
        return 2
    rows = read_rows(metrics)
    if not any("step" in row for row in rows):
        print(f"plot_metrics: error: {metrics} holds no metrics rows yet.", file=sys.stderr)
        return 2
    output = args.output or args.output_dir / "metrics.png"
    plot([row for row in rows if "step" in row], output, title=str(args.output_dir))
    print(f"plot_metrics: wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
