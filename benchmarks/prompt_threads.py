"""How much faster a whole prompt runs on this host when its step takes the router's spare core.

pdserve's colocated server without `--chunk-size` runs its prompt steps on more intra-op threads
than its decode steps (`--prompt-threads auto`, router/workers/threads.py: on the 2-core dev VM
one worker's decode steps run on one thread, its whole prompts on two). A calibration measured
on a server that does not (a `bench probe` of a chunked server, whose prompt steps keep the
worker's thread) prices those prompts at the one-thread rate: on the 2-core EPYC VM the whole
prompts then ran at 0.60-0.69x the price (`plan-verify-{rag,article}-probe-m`, 2026-12-06), and
the plan ranked colocated whole, the best measured candidate, below two chunked ones.

This measures the ratio on the model's own forward, in a child process so that the caller's
torch threads (and a router in the same process) are left alone: the model is built with random
weights of the served model's shapes (timing does not depend on the values, and nothing is
loaded or pulled), one prompt of each length runs at `from` and `to` threads in turn, and the
ratio of the fastest of each is kept, timed on a thread of its own (a worker's engine loop is not
the main thread, and its OpenMP team gained less: docs/plan.md, 2026-12-06). Why not a GEMM of the
model's shapes: on the dev VM one ran 1.95-1.99x faster on two threads, the model's forward 1.72x
(256 tokens) to 1.90x (2,048), its attention and element-wise work scaling less.

    python -m benchmarks.prompt_threads --model smollm2-135m-instruct --from 1 --to 2 --tokens 256,1024
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

REPEATS = 3  # per length and thread count, after one warm-up each (oneDNN builds a kernel per count)
# the prompt lengths measured: the ratio grows with the prompt (module docstring); the shortest
# is the shortest step a server runs on its prompt threads (engine/config.py PROMPT_STEP_TOKENS)
TOKENS = (256, 1024)


def measure_in_child(
    model: str, from_threads: int, to_threads: int, tokens: tuple[int, ...] = TOKENS, timeout_s: float = 180.0
) -> dict[str, Any] | None:
    """`measure` in a child process; None (said on stderr, not raised) when it could not run."""
    cmd = [sys.executable, "-m", "benchmarks.prompt_threads", "--model", model]
    cmd += ["--from", str(from_threads), "--to", str(to_threads), "--tokens", ",".join(map(str, tokens))]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()[-1:] or ["no output"]
        print(f"prompt threads not measured: {tail[0]}", file=sys.stderr)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        print(f"prompt threads not measured: {type(e).__name__}: {e}", file=sys.stderr)
    return None


def model_shapes(model: str) -> Any:
    """The ModelConfig of a preset or registry model (a registry model's files must be here)."""
    from engine.checkpoint.registry import resolve  # noqa: PLC0415
    from engine.config import PRESETS, resolve_model_config  # noqa: PLC0415

    return resolve_model_config(model if model in PRESETS else resolve(model, pull_missing=False))


def shapes_runner(cfg: Any, num_blocks: int) -> Any:
    """A CPU ModelRunner of `cfg`'s shapes with random weights (timing does not depend on the values)
    and an FP8 KV cache of `num_blocks` 16-token blocks."""
    import torch  # noqa: PLC0415

    from engine.config import CacheConfig  # noqa: PLC0415
    from engine.runner.model_runner import ModelRunner  # noqa: PLC0415

    cache = CacheConfig(block_size=16, num_blocks=num_blocks, kv_dtype="fp8")
    return ModelRunner(cfg, cache, "fp8", torch.device("cpu"), None, seed=0)


def measure(model: str, from_threads: int, to_threads: int, tokens: tuple[int, ...]) -> dict[str, Any]:
    """The forward of one prompt of each length at `from_threads` and `to_threads` intra-op
    threads: {"from_threads", "to_threads", "speedup_by_prompt_tokens": {n: ratio}, ...}."""
    import torch  # noqa: PLC0415 - the child only

    from engine.runner.model_runner import StepItem, intra_op_threads  # noqa: PLC0415

    t0 = time.perf_counter()
    cfg = model_shapes(model)
    lengths = sorted({min(n, cfg.max_position_embeddings - 1) for n in tokens})
    runner = shapes_runner(cfg, max(lengths) // 16 + 2)
    speedup: dict[str, float] = {}
    seconds: dict[str, dict[int, float]] = {}

    def timed() -> None:
        torch.set_num_threads(from_threads)
        for n in lengths:
            item = StepItem([5 + i % 1000 for i in range(n)], 0, list(range(n // 16 + 1)), want_logits=False)
            best: dict[int, float] = {}
            for rep in range(REPEATS + 1):
                for threads in (from_threads, to_threads):  # interleaved: a drift in the VM's pace hits both
                    with intra_op_threads(threads), torch.inference_mode():
                        start = time.perf_counter()
                        runner.forward([item])
                        took = time.perf_counter() - start
                    if rep:  # the first of each is oneDNN building its kernels
                        best[threads] = min(best.get(threads, took), took)
            speedup[str(n)] = best[from_threads] / best[to_threads]
            seconds[str(n)] = best

    # on a thread of its own, as a worker's engine loop runs its steps: OpenMP gives each such
    # thread its own team, which gained less from a second thread than the main thread's (SmolLM2,
    # 1,024 tokens: 1.62x against 1.75-1.86x; a deployed server's lone prompts ~1.6x, 2026-12-06)
    worker = threading.Thread(target=timed, name="prompt-threads")
    worker.start()
    worker.join()
    return {
        "model": cfg.name,
        "from_threads": from_threads,
        "to_threads": to_threads,
        "speedup_by_prompt_tokens": speedup,
        "forward_seconds": seconds,
        "how": f"one prompt's forward, random weights of {cfg.name}'s shapes, fastest of {REPEATS} at each "
        "thread count, interleaved, on a thread of a child process (as a worker's engine loop runs it)",
        "seconds": time.perf_counter() - t0,
    }


def host_threads(workers: int) -> dict[int, tuple[int, int]]:
    """Workers -> (decode, prompt) threads of a colocated whole server of that many workers on
    this host, as `pdserve serve` would choose them (router/workers/threads.py; an OMP_NUM_THREADS
    in the environment counts, as it does for the servers `plan --verify` starts): which plan
    candidates the measured ratio prices (costmodel/plan/pricing.py threaded_whole)."""
    from router.workers.threads import choose_prompt_threads, choose_threads  # noqa: PLC0415

    out = {}
    for w in range(1, workers + 1):
        decode = choose_threads(None, w)
        out[w] = (decode.threads, choose_prompt_threads(None, decode, w, whole_colocated=True).threads)
    return out


def on_this_host(base_url: str) -> bool:
    """Whether a server's URL is a loopback address: what is measured here is its host's."""
    from urllib.parse import urlparse  # noqa: PLC0415

    from router.workers.threads import LOOPBACK  # noqa: PLC0415

    return urlparse(base_url).hostname in LOOPBACK


def for_probe(base_url: str, model: str, log: Callable[[str], None]) -> dict[str, Any] | None:
    """The ratio for a calibration `bench probe` writes: measured when the probed server runs on
    this host (a loopback address: a deployment here is what a plan from it starts), pdserve
    knows the model's shapes without pulling anything, and a one-worker colocated whole server
    here gives its prompt steps more threads than its decode steps; None otherwise (logged)."""
    from engine.checkpoint.registry import MODELS, is_pulled  # noqa: PLC0415
    from engine.config import PRESETS, is_checkpoint_dir  # noqa: PLC0415

    if not on_this_host(base_url):
        log("prompt threads: the server is on another host; a plan from this probe prices whole prompts as probed")
        return None
    known = model in PRESETS or is_checkpoint_dir(model) or model in MODELS and is_pulled(model)
    if not known:
        log(f"prompt threads: pdserve does not know {model!r}'s shapes here (--model-config names them); not measured")
        return None
    decode, prompt = host_threads(1)[1]
    if prompt <= decode:
        log(f"prompt threads: a colocated server here runs whole prompts on its decoding's {decode} thread(s)")
        return None
    log(f"prompt threads: timing {model}'s forward at {decode} and {prompt} threads here (~40 s)")
    return measure_in_child(model, decode, prompt)


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--from", dest="from_threads", type=int, required=True)
    p.add_argument("--to", dest="to_threads", type=int, required=True)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    a = p.parse_args()
    tokens = tuple(int(x) for x in a.tokens.split(",") if x.strip())
    print(json.dumps(measure(a.model, a.from_threads, a.to_threads, tokens)))


if __name__ == "__main__":
    _main()
