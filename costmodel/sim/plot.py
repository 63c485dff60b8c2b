"""Per-stream token timelines around one document arrival, one panel per simulated mode."""

from __future__ import annotations

from pathlib import Path

from costmodel.sim.engine import Sim


def _first_doc(sim: Sim, after: float) -> float | None:
    docs = [r.arrival for r in sim.requests if r.kind == "doc" and r.arrival >= after]
    return min(docs) if docs else None


def plot_timelines(
    sims: list[Sim], path: Path, warmup: float, before: float = 0.3, after: float = 1.7, max_streams: int = 16
) -> Path:
    """Each dot row is one chat stream in flight when the document arrived; a gap in a row is a
    stall. The shaded span is the document's prefill (arrival to its first token)."""
    import matplotlib  # noqa: PLC0415 - only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")

    fig, axes = plt.subplots(len(sims), 1, figsize=(10, 2.2 * len(sims) + 0.6), sharex=True, squeeze=False)
    for ax, sim in zip(axes[:, 0], sims):
        a = _first_doc(sim, warmup)
        ax.set_title(f"{sim.cfg.label} ({sim.cfg.gpus} GPU{'s' * (sim.cfg.gpus > 1)})", fontsize=9, loc="left")
        ax.set_yticks([])
        if a is None:
            ax.text(0.5, 0.5, "no document arrived after warm-up", transform=ax.transAxes, ha="center")
            continue
        doc = next(r for r in sim.requests if r.kind == "doc" and r.arrival == a)
        ax.axvspan(0, (doc.token_times[0] - a) * 1e3, color="tab:red", alpha=0.12, lw=0)
        ax.axvline(0, color="tab:red", lw=1)
        live = [
            r for r in sim.requests if r.kind == "chat" and r.token_times and r.token_times[0] <= a < r.token_times[-1]
        ]
        for y, r in enumerate(live[:max_streams]):
            xs = [(t - a) * 1e3 for t in r.token_times if a - before <= t <= a + after]
            ax.plot(xs, [y] * len(xs), "|", ms=6, color="tab:blue")
        ax.set_ylabel(f"{min(len(live), max_streams)} streams", fontsize=8)
    axes[-1, 0].set_xlabel("ms since the document arrived (shaded: its prefill, until its first token)")
    axes[-1, 0].set_xlim(-before * 1e3, after * 1e3)
    fig.suptitle("Simulated token timelines of in-flight streams around a document arrival", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
