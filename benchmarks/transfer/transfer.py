"""`pdserve bench transfer`: KV transfer between two processes, against the article's links.

Sweep: transfer size x block size (tokens) x coalescing on/off x backend. The pulling process
(this one) reads from a second, spawned process that holds the KV pool, exactly as a decode worker
pulls from a prefill worker; every transferred byte is compared with what the holder wrote. A plain
memory copy of the same bytes, timed in the same run, is the ceiling each row is a fraction of.

Size mapping: a synthetic pool with Llama-3.1-70B's per-layer KV shape (8 KV heads x 128 dims, FP8,
K and V: 2 KiB per token per layer) and 8 layers instead of 80, so a token is 16 KiB and a block of
16 / 64 / 256 tokens is 256 KiB / 1 MiB / 4 MiB. Every size is then a whole number of blocks
(sizes below one block are skipped); 640 MiB = 671,088,640 bytes, the article's 4k-prompt KV of the
full 80-layer model. The pool carries no fp32 scales here so sizes stay exact (pdserve's real pool
adds 3.1% to every block; bytes are bytes to the transport). Coalescing off ships one descriptor per
block, which is what a per-block transport does; with 80 layers blocks are 10x larger.

The "local" backend copies inside one process (colocated mode), so both its pools live here.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cli import CliError
from cli.output import emit_json
from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result
from transport import LINKS_GBPS, make_transport
from transport.integrity import block_checksums
from transport.wire import KVHandle, KVLayout

BYTES_PER_TOKEN_LAYER = 2 * 8 * 128  # K+V, 8 KV heads x 128 dims, FP8 (Llama-3.1-70B)
LAYERS = 8
SEED = 1234
SIZES_MB = "1,16,256,640,1024"  # MiB; 640 MiB = 671,088,640 bytes


@dataclass
class Row:
    backend: str
    bytes: int
    block_tokens: int
    coalesced: bool
    descriptors: int
    ms: float  # median of the timed repeats
    gbytes_per_s: float
    verified: bool
    memcpy_gbytes_per_s: float  # same bytes, plain copy, same run
    ratio_to_memcpy: float
    link_ms: dict
    # --verify-kv's work for this transfer (transport/integrity.py): the holder's checksums and
    # the puller's check, medians, and both together as a percentage of the transfer time
    checksum_ms: float = 0.0
    verify_ms: float = 0.0
    verify_cost_pct: float = 0.0


def _layout(block_tokens: int, num_blocks: int) -> KVLayout:
    return KVLayout(
        num_layers=LAYERS,
        num_kv_heads=8,
        head_dim=128,
        block_size=block_tokens,
        dtype="fp8",
        scale_layout="none",
        num_blocks=num_blocks,
    )


def _pattern(nbytes: int, device: str = "cpu") -> torch.Tensor:
    """The holder's pool contents; both processes derive it from SEED to verify every byte."""
    cpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED))
    return cpu if device == "cpu" else cpu.to(device)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _holder_main(conn, pool_bytes: int, block_tokens: list[int], device: str) -> None:
    """The second process: one NIXL agent per block size over the same bytes; serves reads."""
    pool = _pattern(pool_bytes, device)
    transports, infos = [], {}
    for bt in block_tokens:
        layout = _layout(bt, pool_bytes // _layout(bt, 1).block_bytes)
        t = make_transport("nixl", f"bench-holder-{bt}")  # progress thread: answers handshakes
        t.register(pool[: layout.pool_bytes].view(layout.num_blocks, layout.block_bytes), layout)
        transports.append(t)
        infos[bt] = t.describe()
    conn.send(infos)
    conn.recv()  # "quit"
    for t in transports:
        t.close()


def _parse_list(text: str, name: str, cast=int) -> list:
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--{name}: expected a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise CliError(f"--{name}: values must be positive, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["nixl", "local", "all"], default="all")
    p.add_argument(
        "--size-mb", default=SIZES_MB, help=f"transfer sizes in MiB (default {SIZES_MB}; 640 = 671,088,640 B)"
    )
    p.add_argument("--block-tokens", default="16,64,256", help="block sizes in tokens (default 16,64,256)")
    p.add_argument("--coalesce", choices=["both", "on", "off"], default="both")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed transfers per row (at least; rows under 256 MiB repeat up to 20x); the median is reported",
    )
    p.add_argument("--streams", type=int, default=None, help="NIXL parallel copy streams (default min(2, cores))")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where both pools live (default: cuda if available; GPU path not yet measured)",
    )
    p.add_argument("--json", action="store_true", help="print the result object as JSON instead of the table")
    p.add_argument("--name", default="transfer", help="result file name under --out-dir")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--no-plot", action="store_true")


def main(args: argparse.Namespace) -> int:
    sizes = [int(mb * 2**20) for mb in _parse_list(args.size_mb, "size-mb", float)]
    blocks = _parse_list(args.block_tokens, "block-tokens")
    if args.repeats < 1:
        raise CliError("--repeats must be >= 1")
    backends = ["nixl", "local"] if args.backend == "all" else [args.backend]
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.coalesce]
    token_bytes = BYTES_PER_TOKEN_LAYER * LAYERS
    pool_bytes = max(sizes)
    pool_bytes += -pool_bytes % (max(blocks) * token_bytes)  # whole blocks for every block size
    cases = [
        (b, s, bt, c) for b in backends for s in sizes for bt in blocks for c in modes if s % (bt * token_bytes) == 0
    ]
    skipped = sorted({(s, bt) for s in sizes for bt in blocks if s % (bt * token_bytes)})
    if not cases:
        raise CliError(
            "no (size, block) pair holds whole blocks; sizes must be multiples of a block "
            f"({token_bytes} B/token x block tokens)"
        )

    print(f"preparing {pool_bytes / 2**20:.0f} MiB pools ...", file=sys.stderr)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    expected = _pattern(pool_bytes, device)
    dst = torch.zeros(pool_bytes, dtype=torch.uint8, device=device)  # zero_ also faults every page in

    memcpy: dict[int, list[float]] = {}
    ctx = mp.get_context("spawn")  # torch + NIXL do not survive fork
    holder = conn = None
    if "nixl" in backends:
        conn, child = ctx.Pipe()
        holder = ctx.Process(target=_holder_main, args=(child, pool_bytes, blocks, device), daemon=True)
        holder.start()
    rows: list[Row] = []
    transports = {}
    try:
        if holder is not None:
            assert conn is not None  # made with the holder
            if not conn.poll(300):
                raise CliError("the holder process did not start within 300 s")
            peers = conn.recv()
        for bt in blocks:
            layout = _layout(bt, pool_bytes // _layout(bt, 1).block_bytes)
            view = dst[: layout.pool_bytes].view(layout.num_blocks, layout.block_bytes)
            if "nixl" in backends:
                t = make_transport("nixl", f"bench-puller-{bt}", progress_thread=False, streams=args.streams)
                t.register(view, layout)
                transports[("nixl", bt)] = (t, peers[bt])
            if "local" in backends:
                src = make_transport("local", f"bench-local-src-{bt}")
                src.register(expected[: layout.pool_bytes].view(layout.num_blocks, layout.block_bytes), layout)
                t = make_transport("local", f"bench-local-dst-{bt}")
                t.register(view, layout)
                transports[("local", bt)] = (t, src.describe())
                transports[("local-src", bt)] = (src, None)
        for backend, size, bt, coalesced in tqdm(cases, desc="transfer sweep", file=sys.stderr):
            t, peer = transports[(backend, bt)]
            assert t.layout is not None  # registered above
            n = size // (bt * token_bytes)
            ids = list(range(n))
            src_view = expected[: t.layout.pool_bytes].view(t.layout.num_blocks, t.layout.block_bytes)
            sum_times = []
            for _ in range(3):  # what the holder does once per prompt with --verify-kv (same bytes)
                _sync(device)
                t0 = time.perf_counter()
                sums = block_checksums(src_view, ids)
                sum_times.append(time.perf_counter() - t0)
            handle = KVHandle(
                f"bench-{size}-{bt}", peer, tuple(ids), n * bt, t.layout.compat_hash, time.time() + 3600, sums
            )
            t.read(handle, ids, timeout_s=120, coalesced=coalesced)  # warm-up (connection, pages)
            stats, copies = [], []
            verified = True
            # Small transfers take microseconds on a shared 2-core box: repeat them more.
            for _ in range(max(args.repeats, min(20, (256 << 20) // size))):
                # The baseline runs under the same conditions, interleaved: same bytes into the same
                # (zeroed, so cache-cold) destination, right after each transfer.
                dst[:size].zero_()
                stats.append(t.read(handle, ids, timeout_s=120, coalesced=coalesced))
                verified = verified and torch.equal(dst[:size], expected[:size])
                dst[:size].zero_()
                _sync(device)
                t0 = time.perf_counter()
                dst[:size].copy_(expected[:size])
                _sync(device)
                copies.append(time.perf_counter() - t0)
            secs = statistics.median(s.seconds for s in stats)
            gbps, memcpy_gbps = size / secs / 1e9, size / statistics.median(copies) / 1e9
            memcpy.setdefault(size, []).append(memcpy_gbps)
            rows.append(
                Row(
                    backend,
                    size,
                    bt,
                    coalesced,
                    stats[0].descriptors,
                    secs * 1e3,
                    gbps,
                    verified,
                    memcpy_gbps,
                    gbps / memcpy_gbps,
                    stats[0].link_ms,
                    statistics.median(sum_times) * 1e3,
                    statistics.median(st.verify_s for st in stats) * 1e3,
                    (statistics.median(sum_times) + statistics.median(st.verify_s for st in stats)) / secs * 100,
                )
            )
    finally:
        for t, _ in transports.values():
            t.close()
        if holder is not None and conn is not None:
            conn.send("quit")
            holder.join(30)

    memcpy_med = {s: statistics.median(g) for s, g in sorted(memcpy.items())}
    memcpy_ref = memcpy_med[max(memcpy_med)]
    result = {
        "rows": [asdict(r) for r in rows],
        "memcpy_gbytes_per_s": memcpy_ref,
        "memcpy_by_size": {str(s): g for s, g in memcpy_med.items()},
        "pool_device": device,
        "links_gbytes_per_s": LINKS_GBPS,
        "skipped_size_block": skipped,
        "mapping": {
            "bytes_per_token": token_bytes,
            "layers": LAYERS,
            "kv_heads": 8,
            "head_dim": 128,
            "dtype": "fp8",
            "scales": "none",
        },
    }
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    path = write_result(args.name, result, config=config, out_dir=out_dir)
    png = None if args.no_plot else _plot(rows, memcpy_med, out_dir / f"{args.name}.png")
    if args.json:
        emit_json(result)
    else:
        _print_table(rows, memcpy_ref, skipped)
        print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0 if all(r.verified for r in rows) else 1


def _print_table(rows: list[Row], memcpy_ref: float, skipped: list) -> None:
    print(
        f"{'backend':<7} {'bytes':>13} {'blk':>4} {'coal':>4} {'descs':>6} {'ms':>9} {'GB/s':>7} "
        f"{'/memcpy':>7} {'ok':>3} {'NVLink ms':>9} {'IB400 ms':>8} {'IB100 ms':>8} {'sum ms':>7} {'check ms':>8} "
        f"{'verify %':>8}"
    )
    for r in rows:
        print(
            f"{r.backend:<7} {r.bytes:>13,} {r.block_tokens:>4} {'on' if r.coalesced else 'off':>4} "
            f"{r.descriptors:>6} {r.ms:>9.2f} {r.gbytes_per_s:>7.2f} {r.ratio_to_memcpy:>7.2f} "
            f"{'yes' if r.verified else 'NO':>3} {r.link_ms['nvlink']:>9.2f} {r.link_ms['ib-400g']:>8.2f} "
            f"{r.link_ms['ib-100g']:>8.2f} {r.checksum_ms:>7.2f} {r.verify_ms:>8.2f} {r.verify_cost_pct:>8.1f}"
        )
    print(f"memcpy (same run, interleaved with the transfers, largest size): {memcpy_ref:.2f} GB/s")
    for backend in sorted({r.backend for r in rows}):
        at = [r.ratio_to_memcpy for r in rows if r.backend == backend and r.bytes == 256 << 20]
        if at:
            print(
                f"{backend}: 256 MiB rows reach {statistics.median(at):.2f}x of the same-run memcpy "
                f"(median of {len(at)} rows; CPU target >= 0.5)"
            )
    if skipped:
        print(
            "skipped (size smaller than or not a multiple of one block): "
            + ", ".join(f"{s:,} B @ {bt} tok" for s, bt in skipped)
        )


def _plot(rows: list[Row], memcpy: dict, path: Path) -> Path:
    import matplotlib  # noqa: PLC0415 - only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")

    fig, ax = plt.subplots(figsize=(11, 5.5))
    # colour: backend; line: coalescing (solid on, dotted off); marker: block size
    colours = {"nixl": "tab:blue", "local": "tab:green"}
    markers = {16: "o", 64: "s", 256: "^"}
    series = sorted({(r.backend, r.block_tokens, r.coalesced) for r in rows})
    for backend, bt, coalesced in series:
        pts = sorted(
            (r.bytes, r.gbytes_per_s)
            for r in rows
            if (r.backend, r.block_tokens, r.coalesced) == (backend, bt, coalesced)
        )
        ax.plot(
            [p[0] / 1e6 for p in pts],
            [p[1] for p in pts],
            color=colours.get(backend, "tab:purple"),
            marker=markers.get(bt, "D"),
            linestyle="-" if coalesced else ":",
            alpha=0.85,
            label=f"{backend}, {bt}-token blocks, coalescing {'on' if coalesced else 'off'}",
        )
    ms = sorted(memcpy.items())
    ax.plot([s / 1e6 for s, _ in ms], [g for _, g in ms], "k--", label="memcpy (same run)")
    for name, gbps in LINKS_GBPS.items():
        ax.axhline(gbps, color="gray", linewidth=0.8)
        ax.text(
            min(r.bytes for r in rows) / 1e6, gbps * 1.08, f"{name} {gbps:g} GB/s (article)", fontsize=7, color="gray"
        )
    ax.axvline(671.08864, color="red", linewidth=0.6, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("transfer size (MB)")
    ax.set_ylabel("GB/s")
    ax.set_title("KV transfer between two processes (red: 671 MB = 70B FP8 4k prompt)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
