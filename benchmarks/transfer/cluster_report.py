"""The rehearsal's link table, made physical: `bench compare --link-gbps` results at several rates.

    python -m benchmarks.transfer.cluster_report benchmarks/results/cluster-*-1gbit.json \\
        benchmarks/results/cluster-*-10gbit.json --out benchmarks/results/cluster-smollm2

reads the link probes of each result (one per link rate) and writes one Markdown table and one
plot: per link, each document's TTFT, time to second token, decode admission wait, transfer and
max stall, measured beside the simulator's prediction for that link, and the transfer's share of
time-to-second-token (and of the gap between the first and second token, where the pull sits).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.compare.link_probe import max_stall


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        for m in r.get("modes", []):
            lp = m.get("link_probe")
            if not lp:
                continue
            s = lp["summary"]
            stall = max_stall(m)
            ttft, ttst, tx = s["ttft_ms"], s["ttst_ms"], s["transfer_ms"]

            def gap_share(kind: str, ttft: dict = ttft, ttst: dict = ttst, tx: dict = tx) -> float | None:
                a, b, t = ttft.get(kind), ttst.get(kind), tx.get(kind)
                if a is None or b is None or t is None or b <= a:
                    return None
                return t / (b - a)

            out.append(
                {
                    "mode": m["label"],
                    "link_gbps": lp["link_gbps"],
                    "model": r.get("model"),
                    "documents": len(lp["documents"]),
                    "prompt_len": lp["documents"][0].get("measured", lp["documents"][0])["prompt_len"]
                    if lp["documents"]
                    else None,
                    "ttft_ms": ttft,
                    "ttst_ms": ttst,
                    "decode_wait_ms": s["decode_wait_ms"],
                    "transfer_ms": tx,
                    "pull_gbits_per_s": s["transfer_gbits_per_s"]["measured"],
                    "stall_max_ms": {"measured": stall[0], "simulated": stall[1]},
                    "transfer_share_of_ttst": s["transfer_share_of_ttst"],
                    "transfer_share_of_second_gap": {
                        "measured": gap_share("measured"),
                        "simulated": gap_share("simulated"),
                    },
                    "commit": (r.get("provenance") or {}).get("git_commit"),
                }
            )
    return sorted(out, key=lambda x: (x["mode"], -x["link_gbps"]))


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(table: list[dict[str, Any]]) -> str:
    head = (
        "| mode | link | TTFT ms | 2nd token ms | decode wait ms | transfer ms | max stall ms | pull Gbit/s | "
        "transfer / TTST | transfer / (TTST - TTFT) |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for x in table:

        def pair(d: dict, fmt: str = "{:.1f}") -> str:
            return f"{_f(d.get('measured'), fmt)} ({_f(d.get('simulated'), fmt)})"

        lines.append(
            f"| {x['mode']} | {x['link_gbps']:g} Gbit/s | {pair(x['ttft_ms'])} | {pair(x['ttst_ms'])} | "
            f"{pair(x['decode_wait_ms'])} | {pair(x['transfer_ms'])} | {pair(x['stall_max_ms'])} | "
            f"{_f(x['pull_gbits_per_s'], '{:.2f}')} | {pair(x['transfer_share_of_ttst'], '{:.0%}')} | "
            f"{pair(x['transfer_share_of_second_gap'], '{:.0%}')} |"
        )
    return (
        head
        + "\n".join(lines)
        + "\n\nmeasured (simulated: the simulator with this machine's calibration, the KV priced at that link's "
        "rate); each document alone, mean over documents; max stall: the longest gap of a chat stream in the "
        "timed run\n"
    )


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    table = [x for x in table if x["transfer_ms"]["measured"] is not None]  # the modes that pull KV
    has_sim = any(x["ttst_ms"]["simulated"] is not None for x in table)
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [f"{x['mode']}\n{x['link_gbps']:g} Gbit/s" for x in table]
    pos = range(len(table))
    panels = (
        (a, [("TTFT", "ttft_ms"), ("2nd token", "ttst_ms"), ("max stall", "stall_max_ms")], "ms"),
        (c, [("transfer", "transfer_ms"), ("decode wait", "decode_wait_ms")], "ms"),
    )
    for ax, parts, unit in panels:
        n = len(parts) * (2 if has_sim else 1)
        w = 0.8 / n
        for i, (name, key) in enumerate(parts):
            j = 2 * i if has_sim else i
            ax.bar([p + (j - (n - 1) / 2) * w for p in pos], [x[key]["measured"] or 0 for x in table], w, label=name)
            if has_sim:
                ax.bar(
                    [p + (j + 1 - (n - 1) / 2) * w for p in pos],
                    [x[key]["simulated"] or 0 for x in table],
                    w,
                    alpha=0.45,
                    hatch="//",
                    label=f"{name} (simulated)",
                )
        ax.set_xticks(list(pos), labels)
        ax.set_ylabel(unit)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # headroom: the legend sits above the bars
        ax.legend(fontsize=7, ncol=2, loc="upper center")
    a.set_title("one document alone (stall: timed run)")
    c.set_title("KV pull and decode admission")
    for key, name in (("transfer_share_of_ttst", "of TTST"), ("transfer_share_of_second_gap", "of TTST - TTFT")):
        b.plot(labels, [100 * (x[key]["measured"] or 0) for x in table], "o-", label=f"measured, {name}")
        if has_sim:
            b.plot(labels, [100 * (x[key]["simulated"] or 0) for x in table], "x--", label=f"simulated, {name}")
    b.set_ylabel("KV transfer share (%)")
    b.set_title("the transfer's share as the link narrows")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.transfer.cluster_report", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("results", nargs="+", help="bench compare result JSONs run with --link-gbps")
    p.add_argument("--out", required=True, help="output stem: writes STEM.md, STEM.png and STEM.json")
    args = p.parse_args(argv)
    table = rows([json.loads(Path(f).read_text()) for f in args.results])
    if not table:
        p.error("no link probes in these results (run bench compare with --link-gbps)")
    out = Path(args.out)
    md = markdown(table)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps({"sources": args.results, "rows": table}, indent=1))
    plot(table, out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
