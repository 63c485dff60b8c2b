"""What one engine step costs on this device, fitted from measured steps.

The article prices a prefill at one FLOP rate. On a real engine (and, starkly, on a CPU) that
under-prices long prompts: attention runs far below the GEMMs' rate, and every step pays a fixed
cost (Python, launches, sampling) whatever it holds. So a step is priced from its *shape*:

    seconds = fixed                                   # per step, whatever it holds
            + per_token     * new tokens               # GEMMs: prompt tokens + one per decode sequence
            + attention     * sum_i n_i * end_i        # prompt chunks' attention pairs, quadratic in context
            + decode_attention * sum_j (c_j + 1)       # decode rows' attention pairs, linear in context
            + per_sequence  * decode sequences         # per-stream bookkeeping
            + per_prompt    * (1 if the step computes prompt tokens)   # the prompt path, once a step
            + context_read  * sum_i end_i              # each prompt chunk reads its whole context's KV

Item i of a step computes n_i new positions [start_i, end_i): a prefill chunk [p, p + n) or a
decode token [c, c + 1). Its attention work is n_i * end_i: each new token scores every position
up to the chunk's end, as the engine's attention computes it (a causal mask hides the upper
triangle but the kernel still computes the n x end score block). A whole prompt of T tokens is T^2
(the article's term); its chunks add up to less (the triangle above each chunk is skipped), which
is what `bench chunks` measures: a 1,024-token prompt in two chunks of 512 ran faster than whole.
A decode token at context c has c + 1 pairs, priced apart: a prompt's pairs are a dense score
block computed at GEMM speed, a decode row's are one query reading (and, FP8, dequantising) its whole
cached context, memory-bound. On the 2-core CPU VM a decode pair cost ~5 us, a prompt pair ~0.1 us
(`pdserve bench step --prompt-len 64,1024,2048`, 2026-12-05): one shared term, pinned by the prompts'
millions of pairs, priced a decode step at a 1,024-token context ~15% short.

The last two price what prompt work costs beyond its tokens and pairs. A step that carries
prompt tokens pays a fixed ~14 ms more than a decode step, once: a step of several short prompts
costs what one prompt of as many tokens costs (`python -m benchmarks.prompt_items`, the model's
forward on one thread, 2026-12-06, AMD EPYC VM: 4 x 37 tokens 199 ms, 1 x 148 205; 8 x 16 162,
1 x 128 163; `benchmarks/results/plan-verify/prompt-items.json`). Priced once per prompt instead,
a fit from a warm-up of lone prompts put four 37-token chats sent together at 300 ms where they
took ~205. A prompt item at a deep start re-reads its whole context's KV (~9-21 us a token; the
engine attends each item on its own, engine/model/cpu_attention.py `_prefill`). Measured
on the 2-core EPYC VM, 2026-12-05 (`pdserve bench chunks --model smollm2-135m-instruct --prompt-len
1024 --chunks 64,256,1024`, `benchmarks/results/plan-verify/chunks-1024-i.json`): a 1,024-token prompt
alone took 1,775 ms in chunks of 64 (a chunk at start 960 145 ms, at start 0 82), 1,579 in chunks of
256, 1,878 whole. The five-term fits of one `--decode 2` calibration's four servers
(`compare-article-x2-i`) priced it at 1.23-1.39x in chunks of 64 and 1.34-1.48x in chunks of 256;
refitted with the two terms, 1.29-1.36x and 1.24-1.32x (docs/plan.md, "A prompt chunk's own path").

`fit()` fits the seven terms by non-negative least squares on *relative* error (a 7 ms chunk and a
700 ms prompt count alike), from the steps `pdserve bench chunks` times. `OnlineStepFit` refines
them from the step timings workers report while serving, exponentially weighted (a step `half_life`
steps old weighs half), pulled towards the calibration so a few odd steps cannot swing it.
Pure Python: the router uses it and imports no numpy-heavy or torch code.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from costmodel.fit.nnls import nnls_rel, solve_spd

TERMS = (
    "fixed_ms",
    "per_token_us",
    "attention_ns_per_pair",
    "decode_attention_ns_per_pair",
    "per_sequence_us",
    "per_prompt_ms",
    "context_read_us_per_token",
)
# the terms a probe from outside tells apart (costmodel/fit/probe_fit.py): the last two are 0 there
OUTSIDE_TERMS = 5
# seconds per unit of each feature, to display units (ms, us, ns, ns, us, ms, us)
_UNIT = (1e3, 1e6, 1e9, 1e9, 1e6, 1e3, 1e6)
# a calibration written before decode pairs were priced apart priced them at the prompt's rate;
# one written before the prompt items' terms priced them at nothing (None)
_OPTIONAL = {
    "decode_attention_ns_per_pair": "attention_ns_per_pair",
    "per_prompt_ms": None,
    "context_read_us_per_token": None,
}
_N = len(TERMS)


@dataclass(frozen=True)
class StepShape:
    """The features of one step: what a worker reports and what the fit prices."""

    prefill_tokens: int = 0
    attention_pairs: float = 0.0  # every item's, decode rows' included
    decode_seqs: int = 0
    decode_pairs: float = 0.0  # the decode rows' share of attention_pairs
    prefill_seqs: int = 0  # prompt items (chunks) the step computes
    prefill_reads: float = 0.0  # sum over them of the context each reads (start + n): KV tokens gathered

    @classmethod
    def of(cls, decode_contexts: Iterable[int] = (), chunks: Iterable[tuple[int, int]] = ()) -> StepShape:
        """A step of decode sequences at `decode_contexts` (cached tokens each) plus prompt chunks
        `(start, n)`."""
        ctxs = list(decode_contexts)
        dpairs = sum(c + 1 for c in ctxs)
        pairs, toks, items, reads = dpairs, 0, 0, 0
        for start, n in chunks:
            pairs += n * (start + n)
            toks += n
            items += 1
            reads += start + n
        return cls(toks, float(pairs), len(ctxs), float(dpairs), items, float(reads))

    @classmethod
    def reported(
        cls,
        prefill_tokens: int,
        attention_pairs: float,
        decode_seqs: int,
        decode_pairs: float | None,
        prefill_seqs: int | None = None,
        prefill_reads: float | None = None,
    ) -> StepShape:
        """A step as a worker's log gives it. A log without the decode rows' pairs (a worker of an
        earlier version) is split where it is certain: a step without prompt tokens is all decode.
        One without its prompt items is read as one item (a chunked step's usual load): its context
        is then its prompt pairs over its prompt tokens."""
        if decode_pairs is None:
            decode_pairs = attention_pairs if prefill_tokens == 0 else 0.0
        if prefill_seqs is None:
            prefill_seqs = 1 if prefill_tokens > 0 else 0
        if prefill_reads is None:
            prompt_pairs = float(attention_pairs) - float(decode_pairs)
            prefill_reads = prompt_pairs / prefill_tokens if prefill_tokens > 0 else 0.0
        return cls(
            prefill_tokens, float(attention_pairs), decode_seqs, float(decode_pairs), prefill_seqs, float(prefill_reads)
        )

    def features(self) -> tuple[float, float, float, float, float, float, float]:
        prompt_pairs = self.attention_pairs - self.decode_pairs
        tokens = float(self.prefill_tokens + self.decode_seqs)
        return (
            1.0,
            tokens,
            prompt_pairs,
            self.decode_pairs,
            float(self.decode_seqs),
            1.0 if self.prefill_seqs > 0 else 0.0,  # once a step (module docstring)
            self.prefill_reads,
        )


@dataclass(frozen=True)
class StepCostFit:
    """The seven fitted terms, in seconds per unit (see the module docstring)."""

    fixed_s: float
    per_token_s: float
    attention_s: float  # per prompt attention pair
    per_sequence_s: float
    samples: int = 0  # steps it was fitted from
    rms_rel_error: float | None = None  # of the fit over those steps
    decode_attention_s: float = -1.0  # per decode attention pair; left out: attention_s's price
    per_prompt_s: float = 0.0  # per step that computes prompt tokens, whatever number of prompts
    context_read_s: float = 0.0  # per context token a prompt item reads (start + n each)

    def __post_init__(self) -> None:
        if self.decode_attention_s < 0:
            object.__setattr__(self, "decode_attention_s", self.attention_s)

    @classmethod
    def of_coef(cls, coef: Sequence[float], **kw: Any) -> StepCostFit:
        """From terms in `features()` order."""
        fixed, tok, att, datt, seq, item, read = (float(c) for c in coef)
        return cls(fixed, tok, att, seq, decode_attention_s=datt, per_prompt_s=item, context_read_s=read, **kw)

    @property
    def coef(self) -> tuple[float, float, float, float, float, float, float]:
        """The terms in `features()` order."""
        return (
            self.fixed_s,
            self.per_token_s,
            self.attention_s,
            self.decode_attention_s,
            self.per_sequence_s,
            self.per_prompt_s,
            self.context_read_s,
        )

    def scaled(self, k: float) -> StepCostFit:
        """Every term `k` times its price."""
        return StepCostFit.of_coef([c * k for c in self.coef], samples=self.samples, rms_rel_error=self.rms_rel_error)

    def seconds(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coef, shape.features()))

    def step_seconds(self, decode_seqs: int, decode_pairs: float, chunks: Iterable[tuple[int, int]] = ()) -> float:
        """`seconds(StepShape.of(contexts, chunks))` from the decode rows' count and attention pairs
        (sum of context + 1), without building the shape: the simulator prices millions of steps
        for a 16-worker plan, and building the shape was a third of its time."""
        toks = 0
        pairs = reads = 0.0
        for start, n in chunks:
            toks += n
            pairs += n * (start + n)
            reads += start + n
        return (
            self.fixed_s
            + self.per_token_s * (toks + decode_seqs)
            + self.attention_s * pairs
            + self.decode_attention_s * decode_pairs
            + self.per_sequence_s * decode_seqs
            + (self.per_prompt_s if toks else 0.0)
            + self.context_read_s * reads
        )

    def decode_seconds(self, contexts: Sequence[int]) -> float:
        return self.seconds(StepShape.of(contexts))

    def prefill_seconds(self, tokens: int, cached: int = 0) -> float:
        """A whole prompt (or its uncached suffix after `cached` tokens) in one step, alone."""
        return self.seconds(StepShape.of((), [(cached, tokens - cached)]))

    def chunk_extra_seconds(self, start: int, n: int) -> float:
        """What adding a chunk to a step that runs anyway costs (no fixed cost)."""
        s = StepShape.of((), [(start, n)])
        return self.seconds(s) - self.fixed_s

    def to_dict(self) -> dict:
        d: dict[str, Any] = {t: c * u for t, c, u in zip(TERMS, self.coef, _UNIT)}
        d.update(samples=self.samples, rms_rel_error=self.rms_rel_error)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StepCostFit:
        unknown = set(d) - set(TERMS) - {"samples", "rms_rel_error"}
        if unknown:
            raise ValueError(f"unknown step_fit fields: {', '.join(sorted(unknown))}")
        missing = [t for t in TERMS if t not in d and t not in _OPTIONAL]
        if missing:
            raise ValueError(f"step_fit lacks {', '.join(missing)}")
        coef = [float(d[t] if t in d else d.get(_OPTIONAL[t] or "", 0.0)) / u for t, u in zip(TERMS, _UNIT)]
        if any(c < 0 or not math.isfinite(c) for c in coef):
            raise ValueError("step_fit terms must be finite and >= 0")
        return cls.of_coef(coef, samples=int(d.get("samples", 0)), rms_rel_error=d.get("rms_rel_error"))

    def describe(self) -> str:
        return (
            f"{self.fixed_s * 1e3:.3f} ms/step + {self.per_token_s * 1e6:.2f} us/token + "
            f"{self.attention_s * 1e9:.4f} ns/prompt attention pair + "
            f"{self.decode_attention_s * 1e9:.1f} ns/decode attention pair + "
            f"{self.per_sequence_s * 1e6:.1f} us/decode sequence + "
            f"{self.per_prompt_s * 1e3:.2f} ms/step with prompt tokens + "
            f"{self.context_read_s * 1e6:.2f} us/context token read"
        )


# ---- fitting ----------------------------------------------------------------------------------
def fit(samples: Sequence[tuple[StepShape, float]]) -> StepCostFit:
    """Non-negative least squares of the seven terms on relative error, over (shape, seconds)
    (costmodel/fit/nnls.py: exact NNLS, every subset of the terms). The context-read term is left
    out unless the prompt steps read contexts READ_SPREAD apart (`_reads_told_apart`)."""
    rows: list[tuple[tuple[float, ...], float]] = [(s.features(), y) for s, y in samples if y > 0]
    if len(rows) < 2:
        raise ValueError("need at least two timed steps to fit the step cost")
    if not _reads_told_apart([s for s, y in samples if y > 0]):
        rows = [((*x[:_READ], 0.0, *x[_READ + 1 :]), y) for x, y in rows]
    try:
        coef, _ = nnls_rel([x for x, _ in rows], [y for _, y in rows])
    except ValueError as e:
        raise ValueError("the timed steps admit no non-negative step-cost fit") from e
    # Least squares on relative error leans toward the faster of steps that scatter (for one
    # shape it lands at sum(1/y) / sum(1/y^2): with timings +-15% about their median, ~4% under
    # their mean), but a stream's latency is a sum of steps: scale every term so the fit's
    # steps add up to the measured ones. The shape of the fit (what each term prices) stays.
    priced = sum(sum(c * v for c, v in zip(coef, x)) for x, _ in rows)
    k = sum(y for _, y in rows) / priced if priced > 0 else 1.0
    out = StepCostFit.of_coef([c * k for c in coef], samples=len(rows))
    errs = [(out.seconds(s) - y) / y for s, y in samples if y > 0]
    return replace(out, rms_rel_error=math.sqrt(sum(e * e for e in errs) / len(errs)))


READ_SPREAD = 2.0
_READ = TERMS.index("context_read_us_per_token")


def _reads_told_apart(shapes: Sequence[StepShape]) -> bool:
    """Whether the prompt items read contexts of different enough lengths (the longest mean
    context READ_SPREAD times the shortest) for the fit to tell a context read from a prompt step's own
    cost. Where every item reads about as much, the two columns are one (a prompt step of 14.3 ms
    or a context token of 387 us priced the same 37-token chats; the second put a 1,024-token
    prompt in chunks of 64 at 2.7x its time: `compare-article-i`'s colocated server, 2026-12-05)."""
    ctx = [s.prefill_reads / s.prefill_seqs for s in shapes if s.prefill_seqs > 0]
    return bool(ctx) and max(ctx) >= READ_SPREAD * max(min(ctx), 1e-9)


# a prompt-thread fit on this many steps or more drops its worst one where that one is off this many
# times the others' typical error (`fit_beside`)
BESIDE_MIN_TRIM = 4
BESIDE_TRIM_FACTOR = 3.0


def fit_beside(samples: Sequence[tuple[StepShape, float]], base: StepCostFit) -> StepCostFit:
    """`base` with its prompt-token and prompt-attention terms refitted on `samples`: steps that ran
    the same engine on more intra-op threads (a colocated CPU worker's prompt steps, --prompt-threads).
    A step's fixed cost and its decode rows' bookkeeping and context reads do not change with the GEMM
    threads, and a warm-up holds only a few such steps (a handful of documents), too few for seven terms.
    With so few, one disturbed step moves the fit: from BESIDE_MIN_TRIM steps on, the worst is dropped
    where it is off BESIDE_TRIM_FACTOR times the others' typical error (the demo's warm-up had a
    298-token prompt beside four streams run 1.58x the same prompt alone, `demo-replay-z`, 2026-12-06:
    of its two such steps, the fit priced the document 1.31x what the next run measured)."""
    samples = [(s, y) for s, y in samples if y > 0]
    out = _fit_beside(samples, base)
    if len(samples) < BESIDE_MIN_TRIM:
        return out
    errs = [abs(out.seconds(s) - y) / y for s, y in samples]
    worst = max(range(len(samples)), key=lambda i: errs[i])
    rest = [e for i, e in enumerate(errs) if i != worst]
    if errs[worst] <= BESIDE_TRIM_FACTOR * max(statistics.median(rest), 0.02):
        return out
    return _fit_beside([x for i, x in enumerate(samples) if i != worst], base)


def _fit_beside(samples: Sequence[tuple[StepShape, float]], base: StepCostFit) -> StepCostFit:
    rows = []
    for s, y in samples:
        x = s.features()
        rest = y - base.fixed_s - sum(c * v for c, v in zip(base.coef[3:], x[3:]))
        if y > 0 and rest > 0:
            rows.append(((x[1], x[2]), rest, y))
    if not rows:
        raise ValueError("no step left to fit beside the base fit")
    (tok, att), _ = nnls_rel([x for x, _, _ in rows], [r for _, r, _ in rows], [y for _, _, y in rows])
    out = replace(base, per_token_s=tok, attention_s=att)
    out = replace(out, samples=len(rows))
    errs = [(out.seconds(s) - y) / y for s, y in samples if y > 0]
    return replace(out, rms_rel_error=math.sqrt(sum(e * e for e in errs) / len(errs)))


class OnlineStepFit:
    """The calibration's fit, refined from live step timings.

    Exponentially weighted least squares on relative error: each new step multiplies the weight
    of everything seen before by 0.5 ** (1 / half_life). A ridge term holds each coefficient near
    the calibration's (`prior_steps` steps' worth of evidence), so a term the recent steps do not
    exercise (no long prompt lately) keeps its calibrated value instead of drifting. Cheap: a 7x7
    solve per `refit()`, nothing per step beyond a 7x7 accumulate."""

    def __init__(self, prior: StepCostFit, half_life: float = 200.0, prior_steps: float = 1.0):
        if half_life <= 0 or prior_steps <= 0:
            raise ValueError("half_life and prior_steps must be positive")
        self.prior = prior
        self.decay = 0.5 ** (1.0 / half_life)
        self.prior_steps = prior_steps
        self._a = [[0.0] * _N for _ in range(_N)]
        self._b = [0.0] * _N
        self.observed = 0
        self.current = prior

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        x, w = shape.features(), 1.0 / (seconds * seconds)
        d = self.decay
        for i in range(_N):
            self._b[i] = d * self._b[i] + w * x[i] * seconds
            for j in range(_N):
                self._a[i][j] = d * self._a[i][j] + w * x[i] * x[j]
        self.observed += 1

    def refit(self) -> StepCostFit:
        if not self.observed:
            return self.current
        # Ridge towards the prior: a coefficient at its prior value costs nothing; moving it by its
        # own size costs as much as `prior_steps` steps mispredicted by 100%. A zero prior term
        # gets the scale the data gives it (one typical step's worth).
        diag = [self._a[i][i] for i in range(_N)]
        a = [row[:] for row in self._a]
        b = self._b[:]
        for i, p in enumerate(self.prior.coef):
            lam = self.prior_steps * (1.0 / (p * p) if p > 0 else diag[i] / max(self.observed, 1))
            a[i][i] += lam
            b[i] += lam * p
        scale = [math.sqrt(a[i][i]) or 1.0 for i in range(_N)]  # Jacobi preconditioning
        sol = solve_spd(
            [[a[i][j] / (scale[i] * scale[j]) for j in range(_N)] for i in range(_N)],
            [b[i] / scale[i] for i in range(_N)],
        )
        if sol is None:
            return self.current
        coef = [max(0.0, v / s) for v, s in zip(sol, scale)]
        self.current = StepCostFit.of_coef(coef, samples=self.prior.samples + self.observed)
        return self.current

    def to_dict(self) -> dict:
        return {"observed_steps": self.observed, "current": self.current.to_dict(), "prior": asdict(self.prior)}
