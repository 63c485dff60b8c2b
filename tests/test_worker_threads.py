"""Worker threads (issue 40): `--threads-per-worker` and its auto rule, the CPUs Ray reserves for
each worker, the count each worker reports, and a worker process's own thread count now that its
Ray calls run in small concurrency groups instead of one group of 512 threads.

The rule and the flag are checked as pure functions and parsed flags; the rest on a real server
(Ray actors, uvicorn on 127.0.0.1), whose worker processes' threads are read from /proc.
"""

from __future__ import annotations

import inspect
import itertools
import os
from pathlib import Path

import httpx
import pytest
import torch

from contracts.worker import GenerateRequest, WorkerConfig, WorkerError
from engine.sequence import SamplingParams
from router.config import ConfigError, ServeConfig
from router.workers.host import CALLS_IN_FLIGHT, METHOD_GROUPS, WorkerHost, concurrency_groups
from router.workers.threads import auto_threads, choose_prompt_threads, choose_threads, parse_threads

THREADS_BOUND = 100  # a worker process held ~535 threads with max_concurrency=512; ~50-80 now


# ---- the auto rule -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cores", "workers", "threads"),
    [(2, 1, 2), (2, 2, 1), (2, 4, 1), (1, 1, 1), (16, 3, 5), (64, 8, 8), (3, 2, 1)],
)
def test_auto_shares_the_cores_evenly_at_least_one_each(cores, workers, threads):
    assert auto_threads(cores, workers) == threads


def test_an_explicit_count_beats_the_environment_which_beats_auto():
    no_env: dict[str, str] = {}
    # one core of the router's host is left to the router (router/workers/threads.py says why)
    assert choose_threads(None, 1, cores=2, env=no_env).threads == 1  # colocated alone on 2 cores
    assert choose_threads(None, 1, cores=8, env=no_env).threads == 7
    assert choose_threads(None, 2, cores=8, env=no_env).threads == 3  # 1P1D on 8 cores
    assert choose_threads(None, 2, cores=2, env=no_env).threads == 1  # 1P1D
    assert choose_threads(None, 4, cores=2, env=no_env).threads == 1  # 2P2D
    assert choose_threads(None, 1, cores=2, env={"OMP_NUM_THREADS": "2"}).threads == 2
    assert choose_threads(None, 1, cores=4, env={"OMP_NUM_THREADS": "junk"}).threads == 3  # not a count: auto
    choice = choose_threads(3, 1, cores=2, env={"OMP_NUM_THREADS": "1"})
    assert (choice.threads, choice.why) == (3, "--threads-per-worker")


def test_a_cluster_on_this_host_counts_the_machine_not_what_its_nodes_advertise():
    # the test suite's shared cluster advertises 8 CPUs on a 2-core machine
    here = choose_threads(None, 1, cores=4, nodes=[("127.0.0.1", 8.0)], here=["10.0.0.5"], env={})
    assert here.threads == 3 and "this host" in here.why
    two_local = [("10.0.0.5", 2.0), ("10.0.0.5", 2.0)]
    assert choose_threads(None, 2, cores=2, nodes=two_local, here=["10.0.0.5"], env={}).threads == 1
    # other hosts: their CPUs, the workers spread over the nodes (a 0-CPU head node does not count)
    remote = [("10.0.0.1", 0.0), ("10.0.0.2", 16.0), ("10.0.0.3", 8.0)]
    choice = choose_threads(None, 4, cores=2, nodes=remote, here=["10.0.0.9"], env={})
    assert choice.threads == 4 and "per Ray node" in choice.why  # 8 CPUs / ceil(4 workers / 2 nodes)


def test_prompt_steps_borrow_the_routers_core_only_for_whole_prompts_colocated_here():
    local2 = choose_threads(None, 1, cores=2, env={})
    assert choose_prompt_threads(None, local2, 1, whole_colocated=True).threads == 2
    assert choose_prompt_threads(None, local2, 1, whole_colocated=False).threads == 1  # chunked or disaggregated
    local8 = choose_threads(None, 1, cores=8, env={})
    assert choose_prompt_threads(None, local8, 1, whole_colocated=True).threads == 8
    two = choose_threads(None, 2, cores=2, env={})  # 2 colocated workers: 1 router core, not a whole one each
    assert choose_prompt_threads(None, two, 2, whole_colocated=True).threads == 1
    env = choose_threads(None, 1, cores=2, env={"OMP_NUM_THREADS": "1"})  # an explicit count is kept
    assert choose_prompt_threads(None, env, 1, whole_colocated=True).threads == 1
    remote = choose_threads(None, 1, cores=2, nodes=[("10.0.0.2", 16.0)], here=["10.0.0.9"], env={})
    assert choose_prompt_threads(None, remote, 1, whole_colocated=True).threads == 16  # all its node's already
    asked = choose_prompt_threads(3, local2, 1, whole_colocated=False)
    assert (asked.threads, asked.why) == (3, "--prompt-threads")


# ---- the flag and the YAML key -----------------------------------------------------------------
def _serve(argv: list[str]) -> ServeConfig:
    from cli import build_parser
    from router.serve_cli import config_from_args

    argv = ["serve", *argv]
    return config_from_args(build_parser(argv).parse_args(argv))


def test_the_flag_takes_a_count_or_auto_and_reaches_the_workers():
    assert _serve([]).threads_per_worker is None  # auto
    assert _serve(["--threads-per-worker", "auto"]).threads_per_worker is None
    cfg = _serve(["--threads-per-worker", "3"])
    assert cfg.threads_per_worker == 3 and cfg.worker_config().torch_threads == 3
    assert ServeConfig().worker_config().torch_threads is None  # auto: resolved by the launcher
    assert _serve(["--prompt-threads", "2"]).worker_config().prompt_threads == 2
    wc = _serve(["--prompt-threads-min-tokens", "256"]).worker_config()
    assert wc.prompt_threads_min_tokens == 256 and _serve([]).worker_config().prompt_threads_min_tokens is None
    assert _serve(["--prompt-threads", "auto"]).prompt_threads is None


@pytest.mark.parametrize("flag", ["--threads-per-worker", "--prompt-threads"])
@pytest.mark.parametrize(
    ("value", "message"), [("0", "must be >= 1"), ("-2", "must be >= 1"), ("two", "whole number of threads or auto")]
)
def test_a_bad_flag_is_one_line_naming_it(flag, value, message):
    from cli import CliError

    with pytest.raises(CliError, match=f"{flag}.*{message}") as e:
        _serve([flag, value])
    assert "\n" not in str(e.value)
    with pytest.raises(CliError, match="--prompt-threads-min-tokens 0: must be >= 1"):
        _serve(["--prompt-threads-min-tokens", "0"])


def test_yaml_takes_the_same_values(tmp_path: Path):
    def load(value: str) -> ServeConfig:
        p = tmp_path / "serve.yaml"
        p.write_text(f"model: tiny\nthreads-per-worker: {value}\n")
        return ServeConfig.build(None, p)

    assert load("2").threads_per_worker == 2
    assert load("auto").threads_per_worker is None
    for bad in ("0", "true", "1.5", "[2]"):
        with pytest.raises(ConfigError, match="--threads-per-worker"):
            load(bad)
    assert parse_threads(" AUTO ") is None and parse_threads("4") == 4


def test_help_explains_it():
    import argparse

    from router.serve_cli import add_arguments

    p = argparse.ArgumentParser(prog="pdserve serve")
    add_arguments(p)
    text = " ".join(p.format_help().split())
    assert "--threads-per-worker N|auto" in text and "intra-op torch threads" in text and "OMP_NUM_THREADS" in text
    assert "--prompt-threads N|auto" in text and "no token streams while a whole prompt runs" in text


# ---- the launcher's CPUs and the actor's concurrency groups ------------------------------------
def test_pools_reserve_as_many_cpus_as_threads():
    from router.launch import pool_specs

    cfg = ServeConfig(mode="disagg", model="tiny", prefill=2, decode=2)
    specs = pool_specs(cfg, threads=3)
    assert [(s.role, s.size, s.cpus, s.worker_config.torch_threads) for s in specs] == [
        ("prefill", 2, 3.0, 3),
        ("decode", 2, 3.0, 3),
    ]
    assert [s.cpus for s in pool_specs(cfg)] == [1.0, 1.0]  # no count (torch's default): one CPU


def test_every_worker_call_has_a_concurrency_group():
    """A method left out would run in Ray's default group, one thread for every such call."""
    public = {n for n, f in inspect.getmembers(WorkerHost, inspect.isfunction) if not n.startswith("_")}
    assert public == set(METHOD_GROUPS)
    assert set(METHOD_GROUPS.values()) == set(CALLS_IN_FLIGHT)
    # the calls that wait never share a group with the ones that must answer at once
    waits = {"prefill", "submit_prompt", "submit_prefilled", "open_stream", "abort", "release", "cache_events"}
    assert not {METHOD_GROUPS[m] for m in waits} & {METHOD_GROUPS[m] for m in ("ping", "stats", "poll_events")}
    assert concurrency_groups("prefill")["poll"] == 1 and concurrency_groups("colocated")["prefill"] == 1
    assert sum(concurrency_groups("prefill").values()) < 64 and sum(concurrency_groups("decode").values()) < 64


# ---- calibrations and the simulator know the threads ------------------------------------------
def test_calibrations_record_the_threads_and_predictions_carry_them(tmp_path: Path):
    import json

    from benchmarks.client.step_log import StepLogRecorder
    from benchmarks.compare.calibrate.calibration import build as build_self_calibration
    from benchmarks.compare.calibrate.calibration import fit_pools, prediction_setup
    from costmodel.article import cost_model as cm
    from costmodel.sim.compare_predict import setup_from_calibration

    # a server's step log, as GET /v1/workers/steps answers it
    entry = {"prefill_tokens": 0, "attention_pairs": 100.0, "seconds": 0.01, "end_unix_s": 1.0, "torch_threads": 2}
    rec = StepLogRecorder("http://unused")
    rec.add([{"worker": "colocated-0", "role": "colocated", "torch_threads": 2,
              "steps": [{**entry, "step": i, "decode_seqs": 1 + i % 4, "attention_pairs": 50.0 * (1 + i % 7)}
                        for i in range(1, 20)]}])  # fmt: skip
    assert {s.torch_threads for s in rec.steps} == {2}
    assert fit_pools(rec.steps)["colocated"].torch_threads == 2
    cal = build_self_calibration(rec.steps, [], [], 1000)
    assert cal.torch_threads == 2 and cal.to_dict()["pools"]["colocated"]["torch_threads"] == 2
    setup, why = prediction_setup("tiny", "colocated", cal)
    assert why is None and setup is not None and setup.describe()["torch_threads"] == 2

    # a calibration file: the field round-trips, is checked, and reaches the prediction setup
    path = tmp_path / "c.calibration.json"
    path.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", peak_tflops=0.1, torch_threads=2).to_dict()))
    assert cm.Calibration.load(path).torch_threads == 2
    assert setup_from_calibration("tiny", path).torch_threads == 2
    with pytest.raises(ValueError, match="torch_threads"):
        cm.Calibration.from_dict({"torch_threads": 0})
    assert cm.Calibration.from_dict({}).torch_threads is None  # older files: not recorded


def test_simulate_says_which_threads_its_calibration_was_measured_with(tmp_path: Path, capsys):
    import json

    from cli import build_parser
    from costmodel import simulate
    from costmodel.article import cost_model as cm

    path = tmp_path / "c.calibration.json"
    path.write_text(json.dumps(cm.Calibration(device="cpu", dtype="fp32", peak_tflops=0.1, torch_threads=3).to_dict()))
    argv = ["simulate", "--calibration", str(path), "--duration", "4", "--warmup", "1", "--no-png"]
    argv += ["--modes", "colocated", "--out-dir", str(tmp_path)]
    assert simulate.main(build_parser(argv).parse_args(argv)) == 0
    assert "measured with 3 intra-op torch threads per worker" in capsys.readouterr().out
    result = json.loads((tmp_path / "simulate.json").read_text())
    assert result["provenance"]["config"]["calibration_torch_threads"] == 3


# ---- workers without Ray -----------------------------------------------------------------------
_names = itertools.count()


def test_an_in_process_worker_sets_and_reports_its_threads():
    """Benchmarks and tests build workers without Ray: their WorkerConfig sets the count too. And
    an abort that arrives before its prefill call (which may wait in Ray's queue) is remembered."""
    from prefill_worker.worker import PrefillWorker

    w = PrefillWorker(WorkerConfig(model="tiny", transport="local", num_blocks=32, torch_threads=1), "wt-prefill")
    try:
        w.abort("gone")
        with pytest.raises(WorkerError, match="aborted"):
            w.prefill(GenerateRequest("gone", list(b"hello there"), SamplingParams(max_tokens=4)))
        r = w.prefill(GenerateRequest(f"r{next(_names)}", list(b"hello there"), SamplingParams(max_tokens=4)))
        w.release(r.request_id)
        s = w.stats()
        log = s.step_log()
        assert s.torch_threads == 1 and log["torch_threads"] == 1
        assert log["steps"] and all(step["torch_threads"] == 1 for step in log["steps"])
    finally:
        w.shutdown()


def test_prompt_steps_run_on_the_prompt_threads_and_the_step_log_says_so():
    """A prefill worker with 1 thread, and 2 for steps of 90 prompt tokens or more: a 100-token
    prompt's step runs on 2, an 80-token one's and a short one's on 1, and each step in the log
    names its own count; the loop thread's count is put back after the step."""
    from prefill_worker.worker import PrefillWorker

    cfg = WorkerConfig(
        model="tiny", transport="local", num_blocks=64, torch_threads=1, prompt_threads=2, prompt_threads_min_tokens=90
    )
    w = PrefillWorker(cfg, "wt-prompt")
    try:
        for prompt in (list(range(1, 101)), list(range(200, 280)), list(b"short one")):  # no shared prefix
            r = w.prefill(GenerateRequest(f"r{next(_names)}", prompt, SamplingParams(max_tokens=2)))
            w.release(r.request_id)
        s = w.stats()
        log = s.step_log()
        assert (s.torch_threads, s.prompt_threads) == (1, 2) and log["prompt_threads"] == 2
        by_len = {step["prefill_tokens"]: step["torch_threads"] for step in log["steps"]}
        assert by_len == {100: 2, 80: 1, 9: 1}
        assert w.call(torch.get_num_threads) == 1
    finally:
        w.shutdown()


# ---- a real server -----------------------------------------------------------------------------
def _worker_processes() -> dict[int, int]:
    """pid -> threads of this test process's Ray worker processes that host a pdserve worker."""

    def parent(pid: int) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def ours(pid: int) -> bool:  # another user's Ray on this machine is not ours
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parent(pid)
        return False

    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            status = (d / "status").read_text()
        except OSError:
            continue
        if title.startswith("ray::WorkerHost") and ours(int(d.name)):
            out[int(d.name)] = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))
    return out


@pytest.mark.ray
@pytest.mark.server
def test_a_server_runs_its_workers_on_the_threads_asked_in_few_process_threads(ray_cluster):
    """Cost: one 1P1D tiny server on the session's Ray cluster."""
    import ray

    from router.server_thread import ServerThread

    cfg = ServeConfig(mode="disagg", model="tiny", num_blocks=64, threads_per_worker=2, kv_transfer="bulk")
    with ServerThread(cfg, startup_timeout_s=240) as srv:
        for i in range(3):
            body = {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4, "ignore_eos": True}
            httpx.post(srv.base_url + "/completions", json=body, timeout=120).raise_for_status()
        workers = httpx.get(srv.base_url + "/workers/steps", timeout=30).json()["data"]
        assert {w["role"] for w in workers} == {"prefill", "decode"}
        for w in workers:
            assert w["torch_threads"] == 2, w["worker"]
            assert w["steps"] and all(s["torch_threads"] == 2 for s in w["steps"]), w["worker"]
        # Ray reserves the same CPUs: every bundle of this server's placement groups asks for 2
        bundles = [
            b
            for pg in ray.util.placement_group_table().values()
            if pg["state"] == "CREATED" and pg["name"].startswith("pdserve-")
            for b in pg["bundles"].values()
        ]
        assert len(bundles) == 2 and all(b["CPU"] == 2.0 for b in bundles), bundles
        threads = _worker_processes()
        assert len(threads) == 2, threads
        assert all(n < THREADS_BOUND for n in threads.values()), threads
