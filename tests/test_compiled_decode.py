"""The compiled CPU decode step (engine/runner/compiled_decode.py) against the eager one.

Cost: torch.compile of the tiny model's step, two graphs (~10-20 s on the 2-core VM, less when
inductor's cache under /tmp is warm).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.config import PRESETS, CacheConfig
from engine.core.llm_engine import LLMEngine
from engine.runner.compiled_decode import CompiledDecode, attach_compiled_decode
from engine.runner.model_runner import ModelRunner
from engine.sequence import SamplingParams, Sequence
from tests.helpers import run_to_completion

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler: no kernel, no inductor"
)


def _greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = LLMEngine(runner, max_num_seqs=len(prompts))
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]
    return run_to_completion(engine, seqs)


@pytest.mark.slow  # torch.compile builds two graphs: ~8 s, out of the inner loop
def test_compiled_decode_equals_eager_with_two_graphs():
    cfg = PRESETS["tiny"]
    runner = ModelRunner(cfg, CacheConfig(block_size=16, num_blocks=64, kv_dtype="fp8"), "fp8", seed=3)
    g = torch.Generator().manual_seed(0)
    # batch 1, then 3 rows of different lengths (tables of 1 to 4 blocks: widths vary per step)
    cases = [
        [torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist()],
        [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 20, 40)],
    ]
    eager = [_greedy(runner, prompts, 24) for prompts in cases]
    graphs = attach_compiled_decode(runner, "default")
    assert isinstance(graphs, CompiledDecode) and graphs.compiles == 2  # batch 1 and batch >= 2, at start
    assert graphs.compile_s > 0
    compiled = [_greedy(runner, prompts, 24) for prompts in cases]
    assert compiled == eager
    assert runner.graph_steps > 0
    assert graphs.compiles == 2  # no recompile for new batch sizes or table widths
    # a replayed decode step after a prompt step on more threads reports the loop's own count
    runner.prompt_threads = torch.get_num_threads() + 1
    _greedy(runner, [list(range(1, 70))], 3)
    assert runner.last_threads == torch.get_num_threads()
    graphs.close()


def test_compiled_decode_refuses_what_it_cannot_run():
    cfg = PRESETS["tiny"]
    fp32_kv = ModelRunner(cfg, CacheConfig(block_size=16, num_blocks=8, kv_dtype="fp32"), "fp32")
    with pytest.raises(ValueError, match="FP8 KV"):
        CompiledDecode(fp32_kv)
    with pytest.raises(ValueError, match="compile mode"):
        CompiledDecode(fp32_kv, "fast")
    assert attach_compiled_decode(fp32_kv, "off") is None and fp32_kv.graphs is None
    assert attach_compiled_decode(fp32_kv, "auto") is None and fp32_kv.graphs is None  # auto: eager, said why


def test_compile_flag_is_checked():
    from router.config import ConfigError, ServeConfig  # noqa: PLC0415

    assert ServeConfig().worker_config().compile == "auto"  # the default: compiled where it applies
    ServeConfig(model="tiny", compile="auto", kv_dtype="fp32").validate()  # auto never refuses a config
    assert ServeConfig.build({"compile": "default"}).worker_config().compile == "default"
    for bad in ({"cpu_gemm": "bf16"}, {"kv_dtype": "fp32"}, {"dtype": "fp32"}):
        with pytest.raises(ConfigError, match="--compile"):
            ServeConfig(model="tiny", compile="default", **bad).validate()


def test_a_served_compiled_step_answers_as_eager(ray_cluster):
    """Cost: a colocated tiny server with --compile default (one Ray actor; ~10-20 s of compiling).
    It compiles before it is ready (2 graphs, counted in /metrics) and answers greedy requests with
    the tokens an eager engine gives."""
    pytest.importorskip("ray")
    import httpx  # noqa: PLC0415
    from openai import OpenAI  # noqa: PLC0415

    from router.config import ServeConfig  # noqa: PLC0415
    from router.serve_cli import ServerThread  # noqa: PLC0415

    prompts = [[7, 8, 9], list(range(30, 70))]
    runner = ModelRunner(PRESETS["tiny"], CacheConfig(block_size=16, num_blocks=128, kv_dtype="fp8"), "fp8")
    want = [_greedy(runner, [p], 12)[0] for p in prompts]
    cfg = ServeConfig(model="tiny", mode="colocated", decode=1, num_blocks=128, compile="default")
    with ServerThread(cfg, startup_timeout_s=240) as srv:
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert any(
            line.startswith("pdserve_worker_compiled_graphs{") and line.endswith(" 2.0")
            for line in metrics.splitlines()
        ), metrics
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        for p, w in zip(prompts, want):
            r = client.completions.create(
                model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.model_extra["pdserve"]["timeline"]["token_ids"] == w
        # an echo with prompt logprobs leaves logits of its prefill behind; the compiled decode steps
        # after it must not read them as their own (a 500 until the runner cleared them every step)
        r = client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=4, temperature=0, echo=True, logprobs=1
        )
        assert len(r.choices[0].logprobs.token_logprobs) == len(prompts[1]) + 4
        r = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
