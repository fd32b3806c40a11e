"""PNGs of ``specctl bench policies`` (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PRODUCT = "goodput"
STYLE = {
    "goodput": dict(color="#d62728", lw=2.4, zorder=5),
    "oracle": dict(color="black", lw=1.6, ls="--", zorder=4),
    "best_static": dict(color="#7f7f7f", lw=1.4, ls=":", zorder=3),
    "trtllm-gate": dict(color="#1f77b4", lw=1.8, ls="-.", zorder=4),
}
PALETTE = ["#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#ff7f0e", "#aec7e8"]


def _style(name: str, i: int) -> dict:
    return STYLE.get(name, dict(color=PALETTE[i % len(PALETTE)], lw=1.1, zorder=2))


METRICS = {
    "goodput_tok_s": ("goodput (tok / s of GPU time)", "vs_oracle", "Goodput per policy"),
    "request_tok_s": ("per-request decode speed (tok / s in the batch)", "request_vs_oracle",
                      "Per-request decode speed per policy"),
}


def plot_goodput(report: dict, path: Path, metric: str = "goodput_tok_s") -> None:
    """One panel per scenario: ``metric`` of every policy, annotated with its ratio to the oracle."""
    xlabel, ratio_key, title = METRICS[metric]
    scenarios = list(report["scenarios"])
    cols = min(3, len(scenarios))
    rows = math.ceil(len(scenarios) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, scenarios):
        entry = report["scenarios"][name]["policies"]
        names = list(entry)
        values = [entry[n][metric] for n in names]
        colors = ["#d62728" if n == PRODUCT else "black" if n == "oracle" else "#7f7f7f" if n == "best_static"
                  else "#9ecae1" for n in names]
        y = range(len(names))
        ax.barh(y, values, color=colors)
        ax.set_yticks(list(y), [f"{n} (d={entry[n]['config']['depth']} w={entry[n]['config']['width']})"
                                if n == "best_static" else n for n in names], fontsize=7)
        ax.invert_yaxis()
        top = max(values) if values else 1.0
        for k, n in enumerate(names):
            ratio = entry[n].get(ratio_key)
            if ratio is not None:
                ax.text(values[k] + top * 0.01, k, f"{ratio:.2f}", va="center", fontsize=7)
        ax.set_xlim(0, top * 1.15)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    for ax in list(axes.flat)[len(scenarios):]:
        ax.axis("off")
    quick = " (quick)" if report["meta"].get("quick") else ""
    fig.suptitle(f"{title}{quick}; numbers: ratio to the oracle", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_series(name: str, series: dict[str, dict], entry: dict, path: Path, gate: dict | None = None) -> None:
    """Decisions (mean depth used per request-step), goodput, batch size and the
    accepted tokens per step of finished requests over time, every policy; the
    oracle's true mean acceptance of position 1 on a second axis; ``gate``
    (``threshold``, ``window``): the TensorRT-LLM gate's line on the last panel."""
    fig, (ax_depth, ax_good, ax_batch, ax_gate) = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    names = sorted(series, key=lambda n: (n in (PRODUCT, "oracle", "trtllm-gate"), n))
    for i, n in enumerate(names):
        s = series[n]
        t = s["t_s"]
        style = _style(n, i)
        label = n
        if n == "best_static":
            c = entry["policies"][n]["config"]
            label = f"best_static d={c['depth']} w={c['width']}"
        ax_depth.plot(t, _nan(s["mean_depth"]), label=label, **style)
        ax_good.plot(t, _nan(s["goodput_tok_s"]), label=label, **style)
        ax_batch.plot(t, _nan(s["mean_batch"]), label=label, **style)
        if "finished_accepted_per_step" in s:
            ax_gate.plot(t, _nan(s["finished_accepted_per_step"]), label=label, **style)
    oracle = series.get("oracle", {})
    if oracle.get("true_alpha1"):
        twin = ax_depth.twinx()
        twin.plot(oracle["t_s"], _nan(oracle["true_alpha1"]), color="#2ca02c", lw=1.0, alpha=0.6,
                  label="true α₁ (mean over requests)")
        twin.set_ylabel("true α₁", color="#2ca02c", fontsize=8)
        twin.tick_params(axis="y", labelsize=7, colors="#2ca02c")
        twin.legend(loc="lower right", fontsize=7)
    ax_depth.set_ylabel("mean depth used\n(0 = off)", fontsize=8)
    ax_good.set_ylabel("goodput (tok/s)", fontsize=8)
    ax_batch.set_ylabel("mean batch size", fontsize=8)
    ax_gate.set_ylabel("accepted tokens per step\nof finished requests", fontsize=8)
    ax_gate.set_xlabel("scenario time (s)", fontsize=8)
    if gate:
        ax_gate.axhline(gate["threshold"], color="#1f77b4", lw=1.0, ls="--")
        ax_gate.text(0.01, gate["threshold"], f" trtllm-gate threshold {gate['threshold']:g} "
                     f"(mean of the last {gate['window']} requests; below it: off for good)",
                     color="#1f77b4", fontsize=7, va="bottom", transform=ax_gate.get_yaxis_transform())
        ax_gate.set_ylim(bottom=0)
    for ax in (ax_depth, ax_good, ax_batch, ax_gate):
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    ax_depth.legend(loc="upper left", fontsize=6.5, ncol=3)
    ax_depth.set_title(f"{name}: decisions and goodput over time (bins of {series[names[0]]['t_s'][0] * 2:.1f} s)",
                       fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _nan(values: list) -> list[float]:
    return [math.nan if v is None else v for v in values]


CLASS_COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]
CLASS_RUNS = {  # policy -> (line style, label suffix)
    PRODUCT: ("-", "goodput (classes)"),
    f"{PRODUCT}-one-class": ("--", "goodput, one class"),
    "oracle": (":", "class oracle"),
}


def plot_classes(name: str, series: dict[str, dict], entry: dict, path: Path) -> None:
    """TPOT per request class over time beside the plan each class got.

    Panels, for the product with classes, the product without them (one
    class) and the class oracle: the TPOT p99 of each class's requests that
    finished in the bin (its target dashed), the mean draft nodes per
    request-step each class was given (the plan as it reached the requests),
    and the mean depth; one colour per class, one line style per policy.
    """
    runs = [p for p in CLASS_RUNS if p in series and "classes" in series[p]]
    if not runs:
        return
    classes = list(series[runs[0]]["classes"])
    per_class = entry["policies"][runs[0]].get("per_class", {})
    fig, (ax_tpot, ax_nodes, ax_depth, ax_batch) = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    for p in runs:
        s = series[p]
        t = s["t_s"]
        ls, label = CLASS_RUNS[p]
        for k, c in enumerate(classes):
            color = CLASS_COLORS[k % len(CLASS_COLORS)]
            cs = s["classes"][c]
            ax_tpot.plot(t, _nan(cs["tpot_ms_p99"]), color=color, ls=ls, lw=1.6, label=f"{c}: {label}")
            ax_nodes.plot(t, _nan(cs["mean_nodes"]), color=color, ls=ls, lw=1.4, label=f"{c}: {label}")
            ax_depth.plot(t, _nan(cs["mean_depth"]), color=color, ls=ls, lw=1.4, label=f"{c}: {label}")
        ax_batch.plot(t, _nan(s["mean_batch"]), color="black", ls=ls, lw=1.2, label=f"batch size: {label}")
    for k, c in enumerate(classes):
        target = per_class.get(c, {}).get("tpot_target_ms")
        if target:
            color = CLASS_COLORS[k % len(CLASS_COLORS)]
            ax_tpot.axhline(target, color=color, lw=0.9, ls=(0, (6, 3)), alpha=0.7)
            q = per_class[c].get("tpot_quantile") or "p99"
            ax_tpot.text(0.01, target, f" {c} target {target:g} ms ({q})", color=color, fontsize=7, va="bottom",
                         transform=ax_tpot.get_yaxis_transform())
    ax_tpot.set_ylabel("TPOT p99 of requests\nfinished in the bin (ms)", fontsize=8)
    ax_nodes.set_ylabel("draft nodes per\nrequest-step (the plan)", fontsize=8)
    ax_depth.set_ylabel("mean depth per\nrequest-step (0 = off)", fontsize=8)
    ax_batch.set_ylabel("mean batch size", fontsize=8)
    ax_batch.set_xlabel("scenario time (s)", fontsize=8)
    for ax in (ax_tpot, ax_nodes, ax_depth, ax_batch):
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=6.5, ncol=3)
    ax_tpot.set_ylim(bottom=0)
    ax_tpot.set_title(f"{name}: TPOT per request class over time beside the plan "
                      f"(bins of {series[runs[0]]['t_s'][0] * 2:.1f} s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grouped_bars(ax, groups: list[str], series: dict[str, list[float | None]], colors: dict[str, str] | None = None,
                 fmt: str = "{:.1f}") -> None:
    """Bars of several series side by side within each group, each labelled with its value (None: no bar)."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        style = (colors or {}).get(name) or PALETTE[i % len(PALETTE)]
        shown = [(x, v) for x, v in zip(xs, values) if v is not None]
        if shown:
            ax.bar([x for x, _ in shown], [v for _, v in shown], width, color=style, label=name)
            for x, v in shown:
                ax.text(x, v, fmt.format(v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.legend(fontsize=8)
