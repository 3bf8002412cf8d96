"""PNG chart of a benchmark report: per case, ple's median against the floor and transformers."""

from __future__ import annotations

from typing import Any

__all__ = ["plot_report"]


def plot_report(report: dict[str, Any], path: str) -> None:
    """Grouped bars (log scale, ms) of ple / transformers / floor for every case that was timed;
    ple's bar is labelled with its speedup and its ratio to the floor. Refused cases are listed
    in the title, never drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [c for c in report["cases"] if c["status"] == "ok"]
    refused = [c["name"] for c in report["cases"] if c["status"] != "ok"]
    series = (("ple", "#1f77b4"), ("transformers", "#d62728"), ("floor", "#7f7f7f"))
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(timed) + 2), 4.8))
    for i, (key, color) in enumerate(series):
        xs, ys = [], []
        for j, c in enumerate(timed):
            v = c["median_ms"].get(key)
            if v is not None:
                xs.append(j + (i - 1) * width)
                ys.append(v)
        bars = ax.bar(xs, ys, width, label=key, color=color)
        if key == "ple":
            for bar, c in zip(bars, [c for c in timed if c["median_ms"].get("ple") is not None]):
                r = c["ratios"]
                label = []
                if r["speedup_vs_transformers"] is not None:
                    label.append(f"{r['speedup_vs_transformers']:.1f}x")
                if r["ple_over_floor"] is not None:
                    label.append(f"{r['ple_over_floor']:.2f}F")
                ax.annotate(
                    "\n".join(label),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_yscale("log")
    ax.set_ylabel("median time per run (ms, log)")
    ax.set_xticks(range(len(timed)))
    ax.set_xticklabels([f"{c['name']}\n{c['shape']}" for c in timed], fontsize=7, rotation=20)
    m = report.get("machine", {})
    title = f"PLE layer vs transformers vs floor (F = ple / floor) - {m.get('cpu_model', '?')}, {m.get('device', '?')}"
    if refused:
        title += f"\nrefused (check failed): {', '.join(refused)}"
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
