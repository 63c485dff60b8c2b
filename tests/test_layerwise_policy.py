"""Layer-wise KV streaming (issue 39 item 6), what decides it (fast, no worker):
router/dispatch/kv_transfer_policy.py's decisions (bulk, layerwise, auto by the cost model, a
request's own mode over the server's), ServeConfig's checks of --kv-transfer and
--kv-stream-layers, and the request body's `kv_transfer` field.
"""

from __future__ import annotations

import pytest

from router.dispatch.kv_transfer_policy import KVTransferPolicy
from tests.layerwise_workers import LAYERS, LAYOUT

pytestmark = pytest.mark.timeout(180)

LONG = 32_768  # prompt tokens whose streaming gains clearly on a 1 Gbit/s link (whatever the measured costs)


def _policy(mode: str, link_gbps: float | None = None, layers_per_group: int = 1) -> KVTransferPolicy:
    return KVTransferPolicy(mode, layers_per_group, LAYERS, LAYOUT.bytes_per_token, link_gbps)


def test_policy_bulk_and_layerwise_are_fixed():
    for n in (1, 16, 300, 100_000):
        assert _policy("bulk").streams(n) is False
        assert _policy("layerwise").streams(n) is True
    assert _policy("layerwise", layers_per_group=3).groups == 2 and _policy("layerwise").groups == LAYERS
    assert _policy("layerwise", layers_per_group=99).groups == 1
    with pytest.raises(ValueError, match="kv_transfer must be one of bulk, layerwise, auto, got 'fast'"):
        _policy("fast")


def test_policy_auto_pulls_whole_until_it_knows_a_prefill_and_a_link():
    auto = _policy("auto")
    assert auto.gain_s(LONG) is None and not auto.streams(LONG)  # nothing known
    auto.observe_pull(10_000_000, 0.08)  # a link rate (1 Gbit/s), measured
    assert auto.gain_s(LONG) is None and not auto.streams(LONG)  # no prefill measured yet
    auto.observe_prefill(0, 1.0)  # nothing learnt from an empty or instant prefill
    auto.observe_prefill(100, 0.0)
    assert not auto.streams(LONG)
    auto.observe_prefill(1000, 1.0)  # 1 ms a token
    assert auto.gain_s(LONG) is not None and auto.streams(LONG)
    nominal = _policy("auto", link_gbps=1.0)  # a nominal link: still needs a prefill
    assert not nominal.streams(LONG)
    nominal.observe_prefill(1000, 1.0)
    assert nominal.streams(LONG)


def test_policy_auto_streams_long_prompts_not_tiny_ones_on_a_slow_link():
    from costmodel.article.layerwise import LinkSpec, layerwise_threshold_tokens

    slow = _policy("auto", link_gbps=1.0)
    slow.observe_prefill(1000, 1.0)  # 1 ms a token
    assert slow.streams(LONG) and slow.gain_s(LONG) > 0
    assert not slow.streams(16) and slow.gain_s(16) < 0  # the stream's opening costs more than it hides
    # the boundary is the cost model's threshold, to the token
    t = layerwise_threshold_tokens(LAYOUT.bytes_per_token, 1e-3, slow.groups, LinkSpec.gbits(1.0))
    assert 16 < t < LONG and slow.streams(t) and not slow.streams(t - 1)
    # a link that is fast for this KV hides almost nothing: the opening is not worth it
    fast = _policy("auto", link_gbps=1000.0)
    fast.observe_prefill(1000, 1.0)
    assert not fast.streams(LONG)


def test_policy_request_override_wins():
    for server in ("bulk", "layerwise", "auto"):
        p = _policy(server)
        assert p.streams(300, "layerwise") is True
        assert p.streams(300, "bulk") is False
        assert p.streams(300, None) is (server == "layerwise")  # the server's own
    lw = _policy("layerwise")
    assert lw.streams(LONG, "auto") is False  # auto asked: decided by auto (nothing known yet)
    lw.observe_prefill(1000, 1.0)
    lw.link_gbps = 1.0
    assert lw.streams(LONG, "auto") is True and lw.streams(16, "auto") is False


def test_serve_config_checks_kv_transfer_flags():
    import argparse

    from cli import CliError
    from router.config import ConfigError, ServeConfig
    from router.serve_cli import add_arguments, config_from_args

    with pytest.raises(ConfigError, match=r"--kv-transfer 'layerwise': .*needs --mode disagg or auto"):
        ServeConfig.build({"mode": "colocated", "model": "tiny", "kv_transfer": "layerwise"})
    # auto (the default) has nothing to stream in colocated mode: accepted, a no-op there
    assert ServeConfig.build({"mode": "colocated", "model": "tiny"}).kv_transfer == "auto"
    with pytest.raises(ConfigError, match=r"--kv-stream-layers 0: must be >= 1"):
        ServeConfig.build({"mode": "disagg", "model": "tiny", "kv_stream_layers": 0})
    with pytest.raises(ConfigError, match=r"--kv-transfer 'fast': must be one of bulk, layerwise, auto"):
        ServeConfig.build({"mode": "disagg", "model": "tiny", "kv_transfer": "fast"})
    ok = ServeConfig.build({"mode": "colocated", "model": "tiny", "kv_transfer": "bulk"})
    assert ok.kv_transfer == "bulk"
    for mode in ("disagg", "auto"):
        cfg = ServeConfig.build({"mode": mode, "model": "tiny", "kv_transfer": "layerwise", "kv_stream_layers": 3})
        assert (cfg.kv_transfer, cfg.kv_stream_layers) == ("layerwise", 3)
    # the same through the command line: a clear error, not a traceback
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(CliError, match="--kv-transfer 'layerwise': .*needs --mode disagg or auto"):
        config_from_args(parser.parse_args("--mode colocated --model tiny --kv-transfer layerwise".split()))
    with pytest.raises(CliError, match="--kv-stream-layers 0: must be >= 1"):
        config_from_args(parser.parse_args("--mode disagg --model tiny --kv-stream-layers 0".split()))


def test_request_body_kv_transfer_is_checked_and_carried():
    """The body field `kv_transfer` (completions and chat): one of bulk, layerwise, auto, carried to
    the orchestrator's request; anything else is a 400 naming the field; absent: the server's."""
    from engine.checkpoint.tokenizer import ByteTokenizer
    from router.openai import protocol as oa

    tok, lim = ByteTokenizer(), oa.Limits("tiny", frozenset({"tiny"}), 256, 320, 32)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for mode in ("bulk", "layerwise", "auto"):
        assert oa.prepare_completion({"prompt": "hi", "kv_transfer": mode}, tok, lim).kv_transfer == mode
        assert oa.prepare_chat({**chat, "kv_transfer": mode}, tok, lim).kv_transfer == mode
    assert oa.prepare_completion({"prompt": "hi"}, tok, lim).kv_transfer is None
    for bad in ("fast", "LAYERWISE", 1):
        with pytest.raises(oa.OpenAIError) as e:
            oa.prepare_completion({"prompt": "hi", "kv_transfer": bad}, tok, lim)
        assert e.value.status == 400 and e.value.body()["error"]["param"] == "kv_transfer", bad
