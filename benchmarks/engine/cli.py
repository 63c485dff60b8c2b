"""The command-line side the engine benchmarks share: the model/device/cost-model/output flags,
`--device` and comma-separated integer flags turned into values, the plain-text table they print,
the finishing touches of their plots, and the flags as the result file records them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import torch

from costmodel.provenance import OUT_DIR_HELP

if TYPE_CHECKING:
    from engine.generate_cli import FlagTarget


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from cli import CliError  # noqa: PLC0415

        raise CliError("--device cuda: no CUDA device is available")
    return torch.device(name)


def parse_ints(text: str, flag: str) -> list[int]:
    from cli import CliError  # noqa: PLC0415

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CliError(f"{flag} needs at least one value, all >= 1 (got {text!r})")
    return sorted(set(vals))


def table(headers: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * x for x in w]), *(fmt(r) for r in rows)])


def swept_axis(ax: Any, xs: list[int]) -> None:
    """Tick and label only the swept values on a log x axis (not its decades), over a light grid."""
    import matplotlib.ticker  # noqa: PLC0415

    ax.set_xticks(xs, [str(x) for x in xs])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3)


def save_figure(fig: Any, path: Any, title: str) -> None:
    """Title, lay out, write (110 dpi) and close a figure: how every engine benchmark ends its plot."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_device_and_dtypes(g: FlagTarget, kv_help: str) -> None:
    """--device as resolve_device reads it (default: cuda if there is one), then --dtype and --kv-dtype."""
    from engine.generate_cli import add_dtype_arguments  # noqa: PLC0415

    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    add_dtype_arguments(g, kv_help=kv_help)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    from engine.config import PRESETS  # noqa: PLC0415

    g = p.add_argument_group("model and device")
    g.add_argument(
        "--model",
        default=None,
        help=f"preset ({', '.join(PRESETS)}) or checkpoint directory "
        "(default: tiny on CPU; llama-3.1-70b on CUDA if it fits, else llama-3.1-8b)",
    )
    add_device_and_dtypes(g, kv_help="KV cache dtype (default fp8, fp32 with --dtype fp32)")
    g.add_argument(
        "--kv-fill",
        choices=["prefill", "random"],
        default=None,
        help="how the decode batch's KV is filled: a prefill of random tokens (CPU default) or "
        "random values written into the pool (CUDA default, fast at long contexts)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default on CPU: 1, because on a shared machine an oversubscribed "
        "thread pool turns into 10-50x outliers; the device probe runs with the same threads, "
        "so predictions stay comparable. Raise it on a quiet machine)",
    )
    c = p.add_argument_group("cost model")
    c.add_argument("--mfu", type=float, default=0.4, help="MFU of the predictions (default 0.4, the article's)")
    c.add_argument(
        "--hardware",
        default=None,
        help="datasheet preset for the predictions (default: the "
        "GPU's datasheet if known, else this run's measured copy bandwidth and GEMM rate)",
    )
    c.add_argument("--peak-tflops", type=float, default=None, help="override the peak used for predictions and MFU")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="result name under --out-dir (default: <bench>-<model>-<device>)")
    o.add_argument(
        "--out-dir",
        default=None,
        help=OUT_DIR_HELP,
    )
    o.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def config_record(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
