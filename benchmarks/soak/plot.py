"""The soak's figure: RSS per worker (and the router) over time, above the requests that ended."""

from __future__ import annotations

import argparse
from pathlib import Path


def plot_soak(r: dict, args: argparse.Namespace, path: Path) -> Path:
    import matplotlib  # noqa: PLC0415 - plotting only when asked

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for name, s in r["workers_rss_mb"].items():
        if s["samples"]:
            t, m = zip(*s["samples"])
            (line,) = a1.plot(t, m, label=f"{name} ({s['role']})", lw=1.2)
            if s.get("heap_samples"):  # dashed: its C heap in use (glibc), part of the RSS above it
                th, used, _ = zip(*s["heap_samples"])
                a1.plot(th, used, color=line.get_color(), lw=0.8, ls="--")
    if r["rss_mb"]:
        t, m = zip(*r["rss_mb"])
        a1.plot(t, m, label="router", color="grey", lw=1, ls=":")
    a1.axvspan(0, r["warmup_s"], color="0.92", zorder=0)
    a1.text(r["warmup_s"] / 2, 0.02, "warm-up", transform=a1.get_xaxis_transform(), ha="center", fontsize=8)
    a1.set_ylabel("RSS (MB; dashed: C heap in use)")
    a1.set_ylim(bottom=0)
    a1.legend(loc="lower right", fontsize=7, ncol=2)
    bins: dict[int, dict[str, int]] = {}
    for ts, outcome, *_ in r["outcomes"]:
        bins.setdefault(int(ts // 10), {}).setdefault(outcome, 0)
        bins[int(ts // 10)][outcome] += 1
    for outcome, color in (("ok", "tab:green"), ("failed", "tab:orange"), ("hung", "tab:red"), ("wrong", "black")):
        xs = sorted(bins)
        a2.plot([x * 10 + 5 for x in xs], [bins[x].get(outcome, 0) for x in xs], label=outcome, color=color)
    for f in r["faults"]:
        for ax in (a1, a2):
            ax.axvline(f["t_s"], color="grey", lw=0.8, ls="--")
    a2.set_ylabel("requests ended / 10 s")
    a2.set_xlabel("seconds" + (" (dashed: a worker SIGKILLed)" if r["faults"] else ""))
    a2.legend(loc="upper right", fontsize=8)
    faults = f"a SIGKILL every {args.fault_interval_s:g} s" if args.fault_interval_s > 0 else "no faults"
    fig.suptitle(f"pdserve bench soak: {args.minutes:g} min, {args.workload} workload, {args.concurrency} streams, "
                 f"{args.model}, {faults}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
