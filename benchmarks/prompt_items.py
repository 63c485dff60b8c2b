"""What a step of several prompts costs against one prompt of as many tokens.

The step fit (costmodel/fit/step_fit.py) charges a step that computes prompt tokens a fixed cost
beyond a decode step's. Whether that cost is paid once per step or once per prompt in it decides
what a burst of short prompts is priced at: a calibration whose warm-up sent its prompts one at a
time cannot tell the two apart, and priced per prompt, four 37-token chats sent together were
predicted at 300 ms where they took ~205 (`bench compare --transfer-from`, schedule B,
2026-12-06). This times the model's forward on both shapes side by side, interleaved so that a
drift in the VM's pace hits each alike: random weights of the served model's shapes (timing does
not depend on the values), one thread (a worker's decode thread), the median of REPEATS after one
warm-up round.

    python -m benchmarks.prompt_items --model smollm2-135m-instruct --shapes 1x148,4x37,1x128,8x16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from costmodel.provenance import OUT_DIR_HELP, RESULTS_DIR, write_result

REPEATS = 6
SHAPES = ((1, 37), (4, 37), (1, 148), (2, 74), (1, 128), (4, 32), (8, 16), (1, 90), (3, 30))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'4x37,1x148' -> [(4, 37), (1, 148)]: prompts per step x tokens each."""
    out = []
    for part in text.split(","):
        items, _, tokens = part.strip().partition("x")
        if not items.isdigit() or not tokens.isdigit() or int(items) < 1 or int(tokens) < 1:
            raise ValueError(f"shape {part!r}: expected PROMPTSxTOKENS, e.g. 4x37")
        out.append((int(items), int(tokens)))
    return out


def measure(model: str, shapes: list[tuple[int, int]], threads: int = 1) -> dict[str, Any]:
    import torch  # noqa: PLC0415 - torch only for this measurement

    from benchmarks.prompt_threads import model_shapes, shapes_runner  # noqa: PLC0415
    from engine.runner.model_runner import StepItem  # noqa: PLC0415

    torch.set_num_threads(threads)
    cfg = model_shapes(model)
    runner = shapes_runner(cfg, max(k * (n // 16 + 1) for k, n in shapes) + 1)

    def step(k: int, n: int) -> list[StepItem]:
        per = n // 16 + 1  # blocks each prompt holds, its own range of the cache
        ids = [[5 + (i * 7 + j) % 1000 for i in range(n)] for j in range(k)]
        return [StepItem(ids[j], 0, list(range(j * per, (j + 1) * per)), want_logits=True) for j in range(k)]

    took: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    with torch.inference_mode():
        for rep in range(REPEATS + 1):
            for k, n in shapes:
                items = step(k, n)
                start = time.perf_counter()
                runner.forward(items)
                if rep:  # the first round builds oneDNN's kernels
                    took[(k, n)].append(time.perf_counter() - start)
    rows = [
        {
            "prompts": k,
            "tokens_each": n,
            "tokens": k * n,
            "ms_median": statistics.median(t) * 1e3,
            "ms_min": min(t) * 1e3,
        }  # fmt: skip
        for (k, n), t in took.items()
    ]
    return {
        "model": cfg.name,
        "threads": threads,
        "rows": rows,
        "how": f"the model's forward (random weights of {cfg.name}'s shapes) on one step of PROMPTS prompts of "
        f"TOKENS tokens each, from position 0, {threads} thread(s), median of {REPEATS} after a warm-up round, "
        "shapes interleaved",
    }


def table(result: dict[str, Any]) -> str:
    lines = ["prompts x tokens   step tokens   median ms   min ms", "-" * 52]
    for r in result["rows"]:
        shape = f"{r['prompts']:>7} x {r['tokens_each']:<6} {r['tokens']:>11}"
        lines.append(f"{shape}   {r['ms_median']:>9.1f}   {r['ms_min']:>6.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="PROMPTSxTOKENS, comma-separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="prompt-items", help="result name (default prompt-items)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    a = p.parse_args()
    try:
        shapes = parse_shapes(a.shapes)
    except ValueError as e:
        p.error(str(e))
    result = measure(a.model, shapes, a.threads)
    path = write_result(a.out, result, config=vars(a), out_dir=Path(a.out_dir) if a.out_dir else RESULTS_DIR)
    print(table(result))
    print(f"result: {path}")


if __name__ == "__main__":
    main()
