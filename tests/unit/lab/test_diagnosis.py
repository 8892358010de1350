"""diagnose(): each rule fires on its evidence, stays silent on a healthy run and on missing data.

The results are built by hand in the shape `run_bench` returns; the healthy one is modelled on
a real run (16 streams of 50 tokens, one worker, 10 ms steps, on a 2-core machine).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import msgspec
import pytest

from cadence.lab.analysis import diagnosis as dx
from cadence.lab.results import BenchResult, Finding


def diagnose(result: dict) -> list[Finding]:
    """The findings for a result built here as plain data, read as the typed result."""
    return dx.diagnose(msgspec.convert(result, BenchResult))


def dist(
    p50: float,
    p90: float | None = None,
    p99: float | None = None,
    *,
    mean: float | None = None,
    max: float | None = None,
    min: float | None = None,
    count: int = 800,
) -> dict:
    p90 = p50 if p90 is None else p90
    p99 = p90 if p99 is None else p99
    return {
        "count": count,
        "mean": p50 if mean is None else mean,
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": p99 if max is None else max,
        "min": p50 if min is None else min,
    }


def empty_dist() -> dict:
    nan = math.nan
    return {"count": 0, "mean": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan, "min": nan}


def cpu(pct_during_run: float, run_s: float = 0.6, idle_s: float = 3.0) -> dict:
    """Samples every 0.1 s: an idle start (client start-up) and then the run itself."""
    samples = [[round(0.1 * i, 1), 0.0] for i in range(1, int(idle_s * 10) + 1)]
    t = idle_s
    for _ in range(int(run_s * 10)):
        t += 0.1
        samples.append([round(t, 1), pct_during_run])
    values = [p for _, p in samples]
    return {
        "pid": 1,
        "cpu_pct_mean": sum(values) / len(values),
        "cpu_pct_max": max(values),
        "samples": samples,
    }


def shares(values: dict[str, float]) -> dict[str, float]:
    total = sum(values.values())
    return {k: v / total for k, v in values.items()}


def healthy() -> dict:
    """16 streams x 50 tokens, 1 worker, 10 ms steps: nothing wrong."""
    ttft_segments = {
        "client_to_front": dist(8.8, 10.2, 10.6, mean=8.6),
        "queue": dist(7.6, 10.3, 11.0, mean=7.6),
        "first_step": dist(12.6, 12.6, 12.6, mean=12.4, max=12.6),
        "transfer": dist(0.6, 0.6, 0.6),
        "buffer": dist(2.0, 2.5, 2.6, mean=1.8),
        "send": dist(3.5, 3.9, 4.1, mean=3.3),
    }
    segments = {
        "client_to_front": ttft_segments["client_to_front"],
        "queue": ttft_segments["queue"],
        "engine_step": dist(10.2, 10.25, 12.6, max=12.6),
        "transfer": dist(0.56, 0.68, 0.76, mean=0.58),
        "buffer": dist(1.55, 2.6, 3.2, mean=1.6),
        "send": dist(0.72, 1.6, 3.4, mean=0.86),
    }
    return {
        "requests": 16,
        "requests_ok": 16,
        "errors_by_code": {},
        "wall_s": 0.6,
        "output_tokens": 800,
        "chunks": 800,
        "requests_per_s": 26.7,
        "tokens_per_s": 1333.0,
        "chunks_per_s": 1333.0,
        "ttft_ms": dist(35.4, 35.9, 36.0, mean=34.3, min=18.5, count=16),
        "itl_ms": dist(10.5, 11.4, 12.1, mean=10.5, max=18.0),
        "chunk_gap_ms": dist(10.5, 11.4, 12.1, mean=10.5, max=18.0),
        "tpot_ms": dist(10.5, 10.6, 10.7, count=16),
        "e2e_ms": dist(550.0, 560.0, 565.0, count=16),
        "chunk_tokens": dist(1.0, 1.0, 1.0, mean=1.0),
        "integrity": {
            "lost_tokens": 0,
            "repeated_tokens": 0,
            "reordered_chunks": 0,
            "short_streams": 0,
        },
        "token_delay_ms": dist(3.06, 3.9, 6.3, mean=3.0),
        "segments_ms": segments,
        "ttft_segments_ms": ttft_segments,
        "segment_shares": {
            "ttft": shares({k: v["mean"] for k, v in ttft_segments.items()}),
            "token": shares(
                {k: segments[k]["mean"] for k in ("engine_step", "transfer", "buffer", "send")}
            ),
        },
        "client": {
            "processes": 1,
            "cpu_s": 0.12,
            "cpu_per_chunk_us": 150.0,
            "busiest_process_cpu_share": 0.2,
        },
        "system": {
            "interval_s": 0.1,
            "processes": {"front": cpu(25.0), "worker0": cpu(3.0), "client0": cpu(20.0)},
            "gpus": [],
            "flags": [],
        },
        "workload": {
            "target": "127.0.0.1:1",
            "requests": 16,
            "concurrency": 16,
            "max_tokens": [50, 50],
            "prompt_tokens": [16, 16],
            "client_processes": 1,
            "channels_per_process": 1,
        },
        "records": [],
    }


def rules(result: dict) -> list[str]:
    return [f.rule for f in diagnose(result)]


def set_shares(r: dict) -> dict:
    """Recompute segment_shares from the segment means, as stats.summarize does."""
    r["segment_shares"] = {
        "ttft": shares({k: v["mean"] for k, v in r["ttft_segments_ms"].items()}),
        "token": shares(
            {k: r["segments_ms"][k]["mean"] for k in ("engine_step", "transfer", "buffer", "send")}
        ),
    }
    return r


# -- healthy and missing data -------------------------------------------------------------------


def test_healthy_run_fires_nothing():
    assert diagnose(healthy()) == []


def test_findings_have_their_keys_with_numeric_evidence():
    r = slow_first_step()
    for finding in diagnose(r):
        assert set(msgspec.to_builtins(finding)) == {
            "rule",
            "finding",
            "evidence",
            "look_at",
            "severity",
        }
        assert finding.severity in ("alarm", "information")
        assert finding.finding and finding.look_at
        assert finding.evidence
        assert all(isinstance(v, (int, float)) for v in finding.evidence.values())


def test_no_timing_and_no_samples_leave_only_the_client_timestamps_to_speak():
    """Without segments or process samples no rule of the server's timing or CPU can point
    anywhere; what the client's own timestamps show still speaks: messages of several tokens
    at a steady interval, a long and even wait for every first message."""
    r = healthy()
    for key in ("token_delay_ms", "segments_ms", "ttft_segments_ms", "segment_shares"):
        del r[key]
    r["ttft_ms"] = dist(900.0, 950.0, 990.0, count=16)
    r["itl_ms"] = dist(10.0, 40.0, 90.0)
    r["chunk_tokens"] = dist(3.0, 4.0, 5.0, mean=3.0)
    r["system"] = {"interval_s": 0.1, "processes": {}, "gpus": [], "flags": []}
    assert rules(r) == ["output_held_back", "slow_first_message"]


def test_empty_distributions_are_missing_data():
    r = healthy()
    r["ttft_ms"] = empty_dist()
    r["itl_ms"] = empty_dist()
    r["tokens_per_s"] = 0.0
    assert rules(r) == []


def test_an_empty_result_fires_nothing():
    assert diagnose({}) == []


# -- ttft_engine_start ----------------------------------------------------------------------------


def slow_first_step() -> dict:
    """--first-step-ms 400: one request in the slow step, the others queued behind it."""
    r = healthy()
    r["ttft_ms"] = dist(433.5, 434.1, 434.5, mean=432.7, min=422.7, count=16)
    r["ttft_segments_ms"]["queue"] = dist(408.0, 410.7, 411.3, mean=383.0, min=1.9, count=16)
    r["ttft_segments_ms"]["first_step"] = dist(12.6, 12.6, 350.8, mean=37.5, max=410.4, count=16)
    r["segments_ms"]["queue"] = r["ttft_segments_ms"]["queue"]
    r["segments_ms"]["engine_step"] = dist(10.2, 10.23, 12.6, mean=10.8, max=410.4)
    return set_shares(r)


def test_slow_first_step_fires_engine_start_not_queueing():
    r = slow_first_step()
    assert r["segment_shares"]["ttft"]["queue"] > 0.8  # the trap: TTFT is mostly queue
    findings = {f.rule: f for f in diagnose(r)}
    assert set(findings) == {dx.RULE_TTFT_ENGINE_START}
    evidence = findings[dx.RULE_TTFT_ENGINE_START].evidence
    assert evidence["first_step_max_ms"] == 410.4
    assert evidence["engine_step_p50_ms"] == 10.2


def test_every_admitting_step_slow_fires_engine_start_by_share():
    """TTFT mostly the admitting step itself: every request's first step is long, and the
    streams are short, so those steps are a fifth of all steps (no single outlier)."""
    r = healthy()
    r["ttft_segments_ms"]["first_step"] = dist(300.0, 320.0, 330.0, mean=300.0, max=330.0, count=16)
    r["segments_ms"]["engine_step"] = dist(10.2, 300.0, 320.0, max=330.0)
    r["ttft_ms"] = dist(330.0, 345.0, 350.0, mean=330.0, count=16)
    findings = diagnose(set_shares(r))
    assert [f.rule for f in findings] == [dx.RULE_TTFT_ENGINE_START]
    assert findings[0].evidence["ttft_share_first_step"] > 0.8


def test_a_slow_step_that_few_requests_saw_does_not_fire():
    """One stalled step in a long run: TTFT p99 does not show it."""
    r = slow_first_step()
    r["ttft_ms"] = dist(35.0, 36.0, 60.0, mean=36.0, max=434.0, count=1000)
    r["ttft_segments_ms"]["queue"] = dist(7.6, 10.3, 30.0, mean=8.0, max=410.0, count=1000)
    assert dx.RULE_TTFT_ENGINE_START not in rules(set_shares(r))


def test_jittery_steps_are_not_a_start_up_stall():
    r = jittery()
    r["ttft_segments_ms"]["first_step"] = dist(11.0, 20.0, 30.0, mean=12.0, max=30.0, count=16)
    assert dx.RULE_TTFT_ENGINE_START not in rules(r)


# -- ttft_queueing -------------------------------------------------------------------------------


def queued() -> dict:
    """--max-batch 4 with 16 streams: requests wait for a batch slot."""
    r = healthy()
    r["ttft_ms"] = dist(650.0, 1200.0, 1310.0, mean=660.0, count=16)
    r["ttft_segments_ms"]["queue"] = dist(630.0, 1180.0, 1290.0, mean=640.0, count=16)
    r["segments_ms"]["queue"] = r["ttft_segments_ms"]["queue"]
    r["tokens_per_s"] = 370.0
    return set_shares(r)


def test_queue_backlog_fires_ttft_queueing_pointing_at_the_workers():
    findings = {f.rule: f for f in diagnose(queued())}
    assert set(findings) == {dx.RULE_TTFT_QUEUEING}
    finding = findings[dx.RULE_TTFT_QUEUEING]
    assert "queue" in finding.finding
    assert "workers" in finding.look_at
    assert finding.evidence["queue_mean_ms"] == 640.0


def test_slow_admission_at_the_front_fires_ttft_queueing_pointing_at_the_front():
    r = healthy()
    r["ttft_ms"] = dist(180.0, 200.0, 210.0, mean=180.0, count=64)
    r["ttft_segments_ms"]["client_to_front"] = dist(150.0, 170.0, 180.0, mean=150.0, count=64)
    finding = {f.rule: f for f in diagnose(set_shares(r))}[dx.RULE_TTFT_QUEUEING]
    assert "client_to_front" in finding.finding
    assert "front" in finding.look_at


def test_a_few_steps_of_ttft_with_a_short_step_is_not_high():
    """5 ms steps, 30 ms TTFT mostly spent reaching the front: the floor keeps it quiet."""
    r = healthy()
    r["segments_ms"]["engine_step"] = dist(5.1, 5.2, 7.0)
    r["itl_ms"] = dist(5.2, 5.6, 6.5)
    r["ttft_ms"] = dist(30.0, 33.0, 35.0, mean=30.0, count=16)
    r["ttft_segments_ms"]["client_to_front"] = dist(15.0, 18.0, 20.0, mean=15.0, count=16)
    r["ttft_segments_ms"]["first_step"] = dist(6.0, 6.5, 7.0, mean=6.0, count=16)
    assert dx.RULE_TTFT_QUEUEING not in rules(set_shares(r))


def test_queueing_far_beyond_a_start_up_stall_is_queueing():
    """A 410 ms stall does not explain a 1.5 s TTFT p99: the rest of the wait is a backlog."""
    r = slow_first_step()
    r["ttft_ms"] = dist(1200.0, 1400.0, 1500.0, mean=1200.0, count=16)
    r["ttft_segments_ms"]["queue"] = dist(1170.0, 1370.0, 1470.0, mean=1170.0, count=16)
    findings = {f.rule: f for f in diagnose(set_shares(r))}
    assert set(findings) == {dx.RULE_TTFT_QUEUEING}
    evidence = findings[dx.RULE_TTFT_QUEUEING].evidence
    assert evidence["startup_stall_ms"] == 410.4
    assert evidence["wait_share"] == pytest.approx((8.6 + 1170.0 - 410.4) / 1200.0, abs=1e-3)


# -- itl_unstable_engine / itl_unstable_network_side ---------------------------------------------


def jittery() -> dict:
    """--jitter-ms 8 --step-ms 10: the steps themselves vary."""
    r = healthy()
    r["itl_ms"] = dist(10.9, 24.8, 38.3, mean=12.7, max=39.2, min=0.6)
    r["chunk_gap_ms"] = dist(12.0, 24.8, 38.3, mean=13.2, max=39.2)
    r["segments_ms"]["engine_step"] = dist(11.6, 24.5, 31.7, mean=11.9, max=31.7, min=0.04)
    r["token_delay_ms"] = dist(4.3, 8.2, 12.9, mean=4.8)
    r["chunk_tokens"] = dist(1.0, 1.0, 2.0, mean=1.1)
    return set_shares(r)


def test_jittery_steps_fire_itl_unstable_engine_only():
    findings = {f.rule: f for f in diagnose(jittery())}
    assert set(findings) == {dx.RULE_ITL_UNSTABLE_ENGINE}
    evidence = findings[dx.RULE_ITL_UNSTABLE_ENGINE].evidence
    assert evidence["engine_share_of_spread"] > 0.6


def network_jitter() -> dict:
    """Steady steps; tokens wait irregularly in the front's buffer (a blocked event loop)."""
    r = healthy()
    r["itl_ms"] = dist(10.4, 28.0, 45.0, mean=13.5, max=80.0)
    r["token_delay_ms"] = dist(3.0, 21.0, 38.0, mean=8.0, max=75.0)
    r["segments_ms"]["buffer"] = dist(1.6, 19.0, 35.0, mean=6.0, max=70.0)
    return set_shares(r)


def test_delivery_jitter_fires_itl_unstable_network_side_naming_the_segment():
    findings = {f.rule: f for f in diagnose(network_jitter())}
    assert set(findings) == {dx.RULE_ITL_UNSTABLE_NETWORK}
    finding = findings[dx.RULE_ITL_UNSTABLE_NETWORK]
    assert "buffer" in finding.finding
    assert finding.evidence["buffer_spread_ms"] == pytest.approx(17.4)
    assert finding.evidence["engine_share_of_spread"] < 0.1


def test_one_stall_in_the_p99_is_not_instability():
    """A single 100 ms stall delays all 16 streams' gaps at once: the p99 moves, the p90 not."""
    r = healthy()
    r["itl_ms"] = dist(10.5, 11.5, 110.0, mean=11.5, max=120.0)
    r["token_delay_ms"] = dist(3.0, 4.0, 100.0, mean=4.0, max=110.0)
    assert rules(r) == []


def test_an_even_split_names_both_sides():
    r = jittery()
    r["itl_ms"] = dist(10.9, 28.0, 40.0, mean=13.0, max=45.0)
    r["token_delay_ms"] = dist(4.0, 15.0, 24.0, mean=6.0)
    assert set(rules(r)) == {dx.RULE_ITL_UNSTABLE_ENGINE, dx.RULE_ITL_UNSTABLE_NETWORK}


def test_moderately_uneven_delivery_is_not_told_apart_from_a_busy_machine():
    r = network_jitter()
    r["itl_ms"] = dist(10.4, 20.0, 45.0, mean=12.0, max=80.0)
    assert rules(r) == []


def test_noise_sized_itl_tails_do_not_fire():
    """Another benchmark on the same 2 cores: ITL p90/p50 1.9, late wake-ups stretch the
    engine's steps to p90/p50 1.4."""
    r = healthy()
    r["itl_ms"] = dist(10.5, 20.0, 40.0, mean=12.0, max=110.0)
    r["segments_ms"]["engine_step"] = dist(10.2, 14.3, 16.0, max=20.0)
    r["token_delay_ms"] = dist(3.0, 7.0, 21.0, mean=4.0)
    assert rules(set_shares(r)) == []


def test_late_wake_ups_on_short_steps_are_not_engine_jitter():
    """5 ms steps on a busy machine: p90/p50 1.85 but only 4.3 ms, while ITL is uneven."""
    r = healthy()
    r["segments_ms"]["engine_step"] = dist(5.1, 9.4, 12.0)
    r["itl_ms"] = dist(5.2, 9.0, 14.0)
    r["token_delay_ms"] = dist(3.0, 5.0, 9.0)
    assert dx.RULE_ITL_UNSTABLE_ENGINE not in rules(set_shares(r))


def test_jitter_still_blamed_on_the_engine_when_delivery_is_noisy_too():
    r = jittery()
    r["token_delay_ms"] = dist(4.3, 30.0, 40.0, mean=8.0)  # engine share 12.9 / 38.6
    assert dx.RULE_ITL_UNSTABLE_ENGINE in rules(r)


def test_sub_millisecond_itl_doubling_is_not_instability():
    r = healthy()
    r["segments_ms"]["engine_step"] = dist(0.5, 0.6, 3.0)
    r["itl_ms"] = dist(0.6, 1.5, 3.5)
    r["tokens_per_s"] = 30000.0
    assert not {dx.RULE_ITL_UNSTABLE_ENGINE, dx.RULE_ITL_UNSTABLE_NETWORK} & set(rules(r))


# -- slow_reader ---------------------------------------------------------------------------------


def slow_reader() -> dict:
    """read_delay_ms 30 with 5 ms steps: tokens queue up after the front (in send)."""
    r = healthy()
    r["ttft_ms"] = dist(21.0, 22.4, 22.8, mean=20.7, count=16)
    r["itl_ms"] = dist(31.1, 32.0, 32.8, mean=31.1)
    r["segments_ms"]["engine_step"] = dist(5.13, 5.17, 7.45)
    r["segments_ms"]["buffer"] = dist(1.08, 1.83, 2.77, mean=1.12)
    r["segments_ms"]["send"] = dist(757.0, 1369.0, 1526.0, mean=761.0)
    r["token_delay_ms"] = dist(758.0, 1371.0, 1527.0, mean=762.0)
    r["tokens_per_s"] = 505.0
    return set_shares(r)


def test_a_slow_reader_fires_slow_reader():
    findings = {f.rule: f for f in diagnose(slow_reader())}
    assert set(findings) == {dx.RULE_SLOW_READER}
    evidence = findings[dx.RULE_SLOW_READER].evidence
    assert evidence["token_share_buffer_send"] > 0.9
    assert "merged_steps_total" not in evidence  # no server metrics scraped
    assert evidence["itl_p50_ms"] == 31.1


def test_merged_chunks_with_a_full_buffer_fire_slow_reader_as_merging():
    r = healthy()
    r["chunk_tokens"] = dist(3.0, 6.0, 8.0, mean=3.4)
    r["itl_ms"] = dist(10.8, 12.0, 14.0)
    r["segments_ms"]["buffer"] = dist(25.0, 40.0, 55.0, mean=27.0)
    r["token_delay_ms"] = dist(27.0, 42.0, 58.0, mean=29.0)
    r["system"]["server_metrics"] = {
        "during_run": {"cadence_merged_steps_total": 1900.0, "cadence_buffer_overflows_total": 0.0}
    }
    findings = {f.rule: f for f in diagnose(set_shares(r))}
    assert dx.RULE_SLOW_READER in findings
    assert "merging" in findings[dx.RULE_SLOW_READER].finding
    assert findings[dx.RULE_SLOW_READER].evidence["merged_steps_total"] == 1900


def test_the_odd_merged_chunk_is_not_a_slow_reader():
    r = healthy()
    r["chunk_tokens"] = dist(1.0, 1.0, 2.0, mean=1.1)
    assert rules(r) == []


# -- CPU: front_cpu_bound, client_saturated, cpu_busy_cards_idle ------------------------------------


def test_front_near_one_core_during_the_run_fires_front_cpu_bound():
    r = healthy()
    r["system"]["processes"]["front"] = cpu(95.0)
    assert r["system"]["processes"]["front"]["cpu_pct_mean"] < 20  # the idle start dilutes it
    findings = {f.rule: f for f in diagnose(r)}
    assert set(findings) == {dx.RULE_FRONT_CPU_BOUND}
    assert findings[dx.RULE_FRONT_CPU_BOUND].evidence["front_cpu_pct"] == 95.0


def test_a_busy_start_up_does_not_make_the_front_cpu_bound():
    r = healthy()
    front = r["system"]["processes"]["front"]
    front["samples"] = [[t, 100.0 if t < 1 else 10.0] for t, _ in front["samples"]]
    assert rules(r) == []


def test_too_few_samples_in_the_run_are_not_evidence():
    r = healthy()
    r["system"]["processes"]["front"] = cpu(99.0, run_s=0.2)
    r["wall_s"] = 0.2
    assert dx.RULE_FRONT_CPU_BOUND not in rules(r)


def test_busy_client_fires_client_saturated():
    r = healthy()
    r["client"]["busiest_process_cpu_share"] = 0.93
    findings = {f.rule: f for f in diagnose(r)}
    assert set(findings) == {dx.RULE_CLIENT_SATURATED}
    assert findings[dx.RULE_CLIENT_SATURATED].evidence["busiest_process_cpu_share"] == 0.93
    assert "--procs" in findings[dx.RULE_CLIENT_SATURATED].look_at


def test_client_samples_alone_fire_client_saturated():
    r = healthy()
    del r["client"]["busiest_process_cpu_share"]
    r["system"]["processes"]["client1"] = cpu(97.0)
    findings = {f.rule: f for f in diagnose(r)}
    assert findings[dx.RULE_CLIENT_SATURATED].evidence["client1_cpu_pct"] == 97.0


def busy_worker_idle_card(card_pct: float) -> dict:
    r = healthy()
    r["system"]["processes"]["worker0"]["cpu_pct_mean"] = 92.0
    r["system"]["gpus"] = [
        {
            "index": 0,
            "util_pct_mean": card_pct,
            "util_pct_max": 9.0,
            "mem_used_mb_max": 800.0,
            "samples": [],
        }
    ]
    return r


def test_a_busy_process_while_the_cards_idle_fires_cpu_busy_cards_idle():
    """The rule reads the samples itself (the sampler raises no flag of its own); the old
    `system.flags` line is what it finds."""
    findings = {f.rule: f for f in diagnose(busy_worker_idle_card(5.0))}
    assert set(findings) == {dx.RULE_CPU_BUSY_CARDS_IDLE}
    assert findings[dx.RULE_CPU_BUSY_CARDS_IDLE].finding == (
        "CPU busy while the cards idle: worker0 at >= 80% of a core, cards at most 5% utilised"
    )
    assert findings[dx.RULE_CPU_BUSY_CARDS_IDLE].evidence["gpu0_util_pct"] == 5.0
    assert findings[dx.RULE_CPU_BUSY_CARDS_IDLE].evidence["worker0_cpu_pct_mean"] == 92.0


def test_busy_cards_or_no_cards_are_not_cpu_busy_cards_idle():
    assert dx.RULE_CPU_BUSY_CARDS_IDLE not in rules(busy_worker_idle_card(dx.IDLE_CARD_PCT))
    no_cards = busy_worker_idle_card(5.0)
    no_cards["system"]["gpus"] = []
    assert dx.RULE_CPU_BUSY_CARDS_IDLE not in rules(no_cards)


def on_host(busy_pct: float, cpus: int = 2, lab_pct: float = 2.0) -> dict:
    """The healthy run on a host whose CPUs were `busy_pct` busy during the run (100 = one
    core), the processes it samples using what they use in `healthy()`."""
    r = healthy()
    host, lab = cpu(busy_pct)["samples"], cpu(lab_pct)["samples"]
    r["system"]["host"] = {
        "cpus": cpus,
        "busy_pct_mean": busy_pct,
        "samples": [[t, busy, mine] for (t, busy), (_, mine) in zip(host, lab, strict=True)],
        "others": [{"pid": 7, "name": "make", "cpu_pct": 150.0}],
    }
    return r


def test_other_work_on_a_full_host_fires_host_contended():
    findings = {f.rule: f for f in diagnose(on_host(195.0))}
    assert set(findings) == {dx.RULE_HOST_CONTENDED}
    evidence = findings[dx.RULE_HOST_CONTENDED].evidence
    ours = evidence["server_cores"] + evidence["client_cores"] + evidence["lab_cores"]
    assert evidence["others_cores"] == pytest.approx(1.95 - ours, abs=0.02)
    assert evidence["other_processes"] == "make (pid 7) 150%"


def test_a_host_with_a_core_to_spare_or_no_other_work_is_not_contended():
    assert rules(on_host(140.0)) == []  # busy, but half a core and more to spare
    assert rules(on_host(195.0, cpus=4)) == []
    ours = sum(p["samples"][-1][1] for p in healthy()["system"]["processes"].values())
    assert rules(on_host(ours + 2.0 + dx.OTHERS_MIN_PCT - 1, cpus=1)) == []  # others < half a core


def contended(r: dict, wakeup_p99: float, wakeup_max: float | None = None) -> dict:
    """`r` on a 2-core host other work filled, whose wake-up probe measured `wakeup_p99`."""
    host = on_host(195.0)["system"]["host"]
    host["wakeups"] = dist(0.1, wakeup_p99 / 2, wakeup_p99, max=wakeup_max or 2 * wakeup_p99)
    r["system"]["host"] = host
    return r


def test_on_a_contended_host_network_side_spread_within_late_wake_ups_is_the_hosts():
    """Tokens wait irregularly on their way to the client (token delay p90 18 ms over its
    p50) on a host other work filled. When the host woke threads up to 10 ms late, two such
    wake-ups (the front's loop, the client's read) make that spread: the host's finding
    stands alone. Wake-ups of 2 ms make no 18 ms: the network side is named beside it."""
    late = rules(contended(network_jitter(), wakeup_p99=10.0))
    assert dx.RULE_HOST_CONTENDED in late and dx.RULE_ITL_UNSTABLE_NETWORK not in late
    prompt = rules(contended(network_jitter(), wakeup_p99=2.0))
    assert {dx.RULE_HOST_CONTENDED, dx.RULE_ITL_UNSTABLE_NETWORK} <= set(prompt)


def test_on_a_contended_host_steps_that_vary_by_a_late_wake_up_are_the_hosts():
    """The engine's steps vary by 13 ms (p90 over p50): jitter on a host whose wake-ups are
    prompt, one late wake-up each on a host whose probe saw 15 ms."""
    late = rules(contended(jittery(), wakeup_p99=15.0))
    assert dx.RULE_HOST_CONTENDED in late and dx.RULE_ITL_UNSTABLE_ENGINE not in late
    prompt = rules(contended(jittery(), wakeup_p99=2.0))
    assert {dx.RULE_HOST_CONTENDED, dx.RULE_ITL_UNSTABLE_ENGINE} <= set(prompt)


# -- under_capacity ------------------------------------------------------------------------------


def low_concurrency() -> dict:
    """One stream at a time on two workers: latency fine, throughput a fraction of capacity."""
    r = healthy()
    r["workload"]["concurrency"] = 1
    r["system"]["processes"]["worker1"] = cpu(2.0)
    r["ttft_ms"] = dist(14.0, 14.6, 15.6, count=8)
    r["tokens_per_s"] = 94.0
    return r


def test_low_concurrency_with_normal_latency_fires_under_capacity():
    findings = {f.rule: f for f in diagnose(low_concurrency())}
    assert set(findings) == {dx.RULE_UNDER_CAPACITY}
    # A true statement about a light load, not a fault: information, never an alarm.
    assert findings[dx.RULE_UNDER_CAPACITY].severity == "information"
    assert not findings[dx.RULE_UNDER_CAPACITY].alarm
    evidence = findings[dx.RULE_UNDER_CAPACITY].evidence
    assert evidence["workers"] == 2
    assert evidence["tokens_per_worker_step"] == pytest.approx(94.0 * 10.2 / 1e3 / 2, abs=0.01)
    assert "concurrency" in findings[dx.RULE_UNDER_CAPACITY].look_at


def test_under_capacity_needs_normal_latency():
    r = low_concurrency()
    r["itl_ms"] = dist(31.0, 32.0, 33.0)  # clients lag: more streams would not help
    assert dx.RULE_UNDER_CAPACITY not in rules(r)
    r = copy.deepcopy(low_concurrency())
    r["ttft_segments_ms"]["queue"] = dist(400.0, 420.0, 430.0, mean=400.0, count=8)
    r["ttft_ms"] = dist(420.0, 440.0, 450.0, mean=420.0, count=8)
    assert dx.RULE_UNDER_CAPACITY not in rules(set_shares(r))


def test_under_capacity_needs_to_know_the_workers():
    r = low_concurrency()
    r["system"]["processes"] = {}
    assert rules(r) == []


# -- requests_failing ----------------------------------------------------------------------------


def failing(ok: int, errors: dict[str, int]) -> dict:
    r = healthy()
    r["requests"] = ok + sum(errors.values())
    r["requests_ok"] = ok
    r["errors_by_code"] = errors
    r["first_error_by_code"] = {code: f"{code.lower()} happened" for code in errors}
    return r


def test_a_server_answering_only_errors_fires_requests_failing():
    """12 of 22060 ok: the run that once said "no rule fired"."""
    findings = {f.rule: f for f in diagnose(failing(12, {"UNAVAILABLE": 22048}))}
    assert dx.RULE_REQUESTS_FAILING in findings
    finding = findings[dx.RULE_REQUESTS_FAILING]
    assert finding.evidence["error_rate"] == pytest.approx(22048 / 22060, abs=1e-4)
    assert finding.evidence["errors_UNAVAILABLE"] == 22048
    assert "UNAVAILABLE" in finding.finding and "unavailable happened" in finding.finding
    assert "went away" in finding.look_at
    assert dx.RULE_UNDER_CAPACITY not in findings  # a failing server has no room to offer


def test_requests_failing_names_every_code_and_the_first_message():
    finding = next(
        f
        for f in diagnose(failing(90, {"DEADLINE_EXCEEDED": 7, "UNAVAILABLE": 3}))
        if f.rule == dx.RULE_REQUESTS_FAILING
    )
    assert finding.evidence["requests_failed"] == 10
    assert finding.evidence["error_rate"] == 0.1
    assert finding.evidence["first_error"] == "DEADLINE_EXCEEDED: deadline_exceeded happened"
    assert "DEADLINE_EXCEEDED 7, UNAVAILABLE 3" in finding.finding


def test_an_error_below_the_share_is_not_requests_failing():
    below = failing(1000, {"CANCELLED": 1})
    assert 1 / 1001 < dx.FAILING_SHARE
    assert dx.RULE_REQUESTS_FAILING not in rules(below)
    assert dx.RULE_REQUESTS_FAILING not in rules(healthy())


def test_an_aborted_run_says_why_in_the_evidence():
    r = failing(0, {"UNAVAILABLE": 5})
    r["aborted"] = "the server stopped answering"
    (finding,) = [f for f in diagnose(r) if f.rule == dx.RULE_REQUESTS_FAILING]
    assert finding.evidence["aborted"] == "the server stopped answering"


# -- client_behind_schedule ----------------------------------------------------------------------


def open_loop(behind: bool | None) -> dict:
    r = healthy()
    r["workload"]["concurrency"] = None
    r["workload"]["rate"] = 400.0
    if behind is not None:
        r["client"].update(
            {
                "behind_schedule": behind,
                "offered_rate_per_s": 400.0,
                "achieved_rate_per_s": 250.0 if behind else 399.0,
                "schedule_slips": 3,
                "schedule_lag_ms": dist(40.0, 120.0, 180.0, max=210.0, count=16),
            }
        )
    return r


def test_a_client_behind_its_schedule_fires_client_behind_schedule():
    findings = {f.rule: f for f in diagnose(open_loop(behind=True))}
    assert set(findings) == {dx.RULE_CLIENT_BEHIND_SCHEDULE}
    finding = findings[dx.RULE_CLIENT_BEHIND_SCHEDULE]
    assert finding.evidence["offered_rate_per_s"] == 400.0
    assert finding.evidence["achieved_rate_per_s"] == 250.0
    assert finding.evidence["schedule_lag_p99_ms"] == 180.0
    assert "250 requests/s of the 400" in finding.finding
    assert "client's, not the server's" in finding.finding


def test_a_client_on_schedule_or_a_result_without_the_fields_is_silent():
    assert dx.RULE_CLIENT_BEHIND_SCHEDULE not in rules(open_loop(behind=False))
    assert dx.RULE_CLIENT_BEHIND_SCHEDULE not in rules(open_loop(behind=None))


# -- the rules laid out -------------------------------------------------------------------------


def test_every_rule_has_a_unique_name_and_gives_way_only_to_known_rules():
    names = [rule.name for rule in dx.RULES]
    assert len(names) == len(set(names))
    assert {way.to for rule in dx.RULES for way in rule.gives_way_to} <= set(names)
    assert {dx.RULE_REQUESTS_FAILING, dx.RULE_CLIENT_BEHIND_SCHEDULE} <= set(names)


def test_an_explained_finding_gives_way():
    """Under capacity's own check holds, but a saturated client explains the small batches."""
    r = low_concurrency()
    r["client"]["busiest_process_cpu_share"] = 0.93
    under = next(rule for rule in dx.RULES if rule.name == dx.RULE_UNDER_CAPACITY)
    assert under.check(dx.RunFacts(msgspec.convert(r, BenchResult)))
    assert rules(r) == [dx.RULE_CLIENT_SATURATED]


# -- results written by the lab before the rules were laid out ----------------------------------


DATA = Path(__file__).parents[2] / "data"


@pytest.mark.parametrize(
    "name",
    [
        "bench_result_v0.json",
        "bench_result_baseline_v0.json",
        "bench_result_open_v0.json",
        "bench_result_openai_v0.json",
        "bench_result_grpc_v0.json",
    ],
)
def test_saved_results_get_the_findings_they_were_written_with(name):
    """The same findings, word for word; their severity is newer than these results (whose
    findings read as alarms), and a light load is now information."""
    written = msgspec.convert(json.loads((DATA / name).read_text()), BenchResult)
    assert all(f.alarm for f in written.diagnosis)
    found = dx.diagnose(written)
    assert [msgspec.structs.replace(f, severity=msgspec.UNSET) for f in found] == written.diagnosis
    assert {f.rule for f in found if not f.alarm} <= {dx.RULE_UNDER_CAPACITY}


def test_a_saved_run_of_errors_only_now_names_them():
    """Every request past its deadline: saved with "no rule fired"."""
    written = msgspec.convert(
        json.loads((DATA / "bench_result_errors_v0.json").read_text()), BenchResult
    )
    assert written.diagnosis == [] and written.requests_ok == 0
    assert [f.rule for f in dx.diagnose(written)] == [dx.RULE_REQUESTS_FAILING]


# -- slow_connect ---------------------------------------------------------------------------------


def slow_connects(connect_p99: float, ttft_p99: float) -> dict:
    """An HTTP run whose requests each opened a connection, some of them slowly."""
    r = healthy()
    r["ttft_ms"] = dist(40.0, 60.0, ttft_p99, count=16)
    r["connect_ms"] = dist(2.0, 3.0, connect_p99, max=connect_p99, count=16)
    r["ttft_after_connect_ms"] = dist(38.0, 57.0, max(ttft_p99 - connect_p99, 40.0), count=16)
    return r


def test_connects_that_make_most_of_ttft_fire_slow_connect_naming_syn_retries():
    found = [f for f in diagnose(slow_connects(1030.0, 1090.0)) if f.rule == "slow_connect"]
    [finding] = found
    assert finding.evidence["connect_p99_ms"] == 1030.0
    assert finding.evidence["ttft_p99_ms"] == 1090.0
    assert "dropped SYN" in finding.finding
    assert "somaxconn" in finding.look_at and "ListenOverflows" in finding.look_at


def test_fast_or_small_connects_and_runs_without_them_do_not_fire_slow_connect():
    assert "slow_connect" not in rules(slow_connects(5.0, 1090.0))  # fast: not slow
    assert "slow_connect" not in rules(slow_connects(150.0, 1090.0))  # a small part of TTFT
    assert "slow_connect" not in rules(healthy())  # gRPC: no connect times at all


def test_on_a_contended_host_an_itl_tail_within_its_bound_is_not_the_network_side():
    """Token delay p90 30 ms over its p50, more than two of the host's late wake-ups (p99
    10 ms) make; but the ITL p99 (45 ms) is within the bound the host's noise floor sets
    (p50 10.4 x 1.5 + 1 + 3 x 10 ms): the tail the verdict calls healthy is the host's."""
    r = network_jitter()
    r["token_delay_ms"] = dist(3.0, 33.0, 38.0, mean=8.0, max=75.0)
    assert {dx.RULE_HOST_CONTENDED, dx.RULE_ITL_UNSTABLE_NETWORK} <= set(
        rules(contended(copy.deepcopy(r), wakeup_p99=4.0))
    )
    late = rules(contended(r, wakeup_p99=10.0))
    assert dx.RULE_HOST_CONTENDED in late and dx.RULE_ITL_UNSTABLE_NETWORK not in late
