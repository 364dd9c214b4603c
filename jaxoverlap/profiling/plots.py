"""The profile's figures, drawn from the report dict alone (so profile.json can be re-plotted):

- timeline_b<B>.png: three consecutive decode steps, a row of device ops and rows of host
  prepare / launch / wait / process, normal loop above overlap loop (article Figs 2 and 11);
- host_time.png: host time per decode iteration, prepare + launch + process, next to the
  device step time (Figs 3 and 12's left half);
- throughput.png: tokens/s with and without overlap per batch size (Fig 12).
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

HOST_COLORS = {"prepare": "tab:blue", "launch": "tab:orange", "wait": "0.85", "process": "tab:green"}
STEP_COLORS = ("tab:purple", "tab:olive", "tab:cyan")
MODE_LABEL = {"overlap": "overlap", "normal": "no overlap"}


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _timeline_axes(ax, mode: str, timeline: dict, device: dict) -> None:
    rows = ["device", "prepare", "launch", "wait", "process"]
    y = {r: len(rows) - 1 - i for i, r in enumerate(rows)}  # device on top
    color_of = {step["launch_index"]: STEP_COLORS[k % len(STEP_COLORS)] for k, step in enumerate(timeline["steps"])}
    # The neighbouring steps' ops in grey: under overlap they fill what would be the gaps.
    ax.broken_barh([(s / 1e3, d / 1e3) for s, d, _ in timeline.get("context", [])], (y["device"] - 0.35, 0.7),
                   facecolors="0.75")
    for step in timeline["steps"]:
        color = color_of[step["launch_index"]]
        # Kernels full height, copies as thin black bars below them.
        kernels = [(s / 1e3, d / 1e3) for s, d, copy in step["ops"] if not copy]
        copies = [(s / 1e3, d / 1e3) for s, d, copy in step["ops"] if copy]
        ax.broken_barh(kernels, (y["device"] - 0.35, 0.7), facecolors=color)
        if copies:
            ax.broken_barh(copies, (y["device"] - 0.45, 0.15), facecolors="k")
        # Host intervals filled by part, outlined in the colour of the step they work for
        # (grey: a step outside the three).
        for part, (start, dur, for_step) in step["host"].items():
            ax.broken_barh([(start / 1e3, dur / 1e3)], (y[part] - 0.35, 0.7), facecolors=HOST_COLORS[part],
                           edgecolors=color_of.get(for_step, "0.5"), linewidth=1.5)
        ax.text((step["start_us"] + step["end_us"]) / 2e3, y["device"] + 0.45,
                f"{(step['end_us'] - step['start_us']) / 1e3:.2f} ms", ha="center", va="bottom", fontsize=7)
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_ylim(-0.6, len(rows) - 0.1)
    gap = device["gap_ms"].get("median")
    step_ms = device["step_ms"].get("median")
    title = f"{MODE_LABEL[mode]}: device step {step_ms:.3f} ms, gap {gap:.3f} ms (medians)" if gap is not None \
        else f"{MODE_LABEL[mode]}"
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


def timeline(batch: dict, path: str) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    for ax, mode in zip(axes, ("normal", "overlap")):
        m = batch["modes"][mode]
        _timeline_axes(ax, mode, m["timeline"], m["device"])
    axes[-1].set_xlabel("ms (from the first step's prepare)")
    fig.suptitle(f"three consecutive decode steps, batch {batch['batch_size']}", fontsize=10)
    _save(fig, path)


def host_time(report: dict, path: str) -> None:
    labels, parts, steps = [], {p: [] for p in ("prepare", "launch", "process")}, []
    for b in report["batches"]:
        for mode in ("normal", "overlap"):
            m = b["modes"][mode]
            labels.append(f"B={b['batch_size']}\n{MODE_LABEL[mode]}")
            for p in parts:
                parts[p].append(m["host"][f"{p}_ms"].get("median", 0.0))
            steps.append(m["device"]["step_ms"].get("median", 0.0))
    x = list(range(len(labels)))
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    w = 0.38
    for p, vals in parts.items():
        ax.bar([i - w / 2 for i in x], vals, w, bottom=bottom, color=HOST_COLORS[p], label=f"host {p}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar([i + w / 2 for i in x], steps, w, color="0.5", label="device step")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("ms per decode step (medians)")
    ax.set_title("host time per step vs device step time", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)


def throughput(report: dict, path: str) -> None:
    batches = report["batches"]
    x = list(range(len(batches)))
    w = 0.38
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(batches)), 4))
    for off, mode, color in ((-w / 2, "normal", "0.6"), (w / 2, "overlap", "tab:blue")):
        vals = [b["modes"][mode]["throughput_tok_s"] for b in batches]
        ax.bar([i + off for i in x], vals, w, color=color, label=MODE_LABEL[mode])
    for i, b in enumerate(batches):
        if b["overlap_gain"] is not None:
            top = max(b["modes"][m]["throughput_tok_s"] for m in ("normal", "overlap"))
            ax.text(i, top, f"{100 * b['overlap_gain']:+.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"B={b['batch_size']}" for b in batches])
    ax.set_ylabel("tokens/s (prompts included)")
    ax.set_title("throughput with and without overlap", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)


def write_all(report: dict, out_dir: str) -> list[str]:
    paths = []
    for b in report["batches"]:
        if all(b["modes"][m]["timeline"]["steps"] for m in ("normal", "overlap")):
            p = os.path.join(out_dir, f"timeline_b{b['batch_size']}.png")
            timeline(b, p)
            paths.append(p)
    for name, fn in (("host_time.png", host_time), ("throughput.png", throughput)):
        p = os.path.join(out_dir, name)
        fn(report, p)
        paths.append(p)
    return paths
