"""The benchmark runner: correctness gate, JSON report, quick smoke run, profile mode."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ple.ngram
from ple.commands.bench import cases as bench_cases
from ple.commands.bench import runner, timing
from ple.commands.cli import main
from ple.layer import PLELayer

_REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run(*argv: str) -> int:
    return runner.run(_args(*argv))


# ---------------------------------------------------------------------------------------------- smoke run + schema


def test_quick_run_writes_schema_json_table_and_plot(tmp_path, capsys):
    out_json, out_png, out_md = tmp_path / "b.json", tmp_path / "b.png", tmp_path / "b.md"
    rc = _run(
        "--quick",
        "--cases",
        "ids,prefill-long-bf16,decode-fp32,session-decode-bf16",
        "--repeat",
        "2",
        "--quiet",
        "--output",
        str(out_json),
        "--plot",
        str(out_png),
        "--markdown",
        str(out_md),
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert table.startswith("| case | shape |")
    assert out_md.read_text() == table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rep = json.loads(out_json.read_text())
    assert rep["schema"] == runner.SCHEMA
    assert set(rep) >= {"schema", "created", "machine", "versions", "settings", "cases", "elapsed_s"}
    m = rep["machine"]
    assert len(m["load_average"]) == 3 and len(m["load_average_start"]) == 3
    assert isinstance(m["cpu_model"], str) and m["cpu_model"]
    assert isinstance(m["cores"], int) and m["cores"] >= 1
    assert m["device"] == "cpu"
    v = rep["versions"]
    assert v["torch"] == torch.__version__
    assert v["ple"] == ple.__version__
    assert v["python"].count(".") == 2
    assert isinstance(v["transformers"], str)
    from ple.kernels import native as _native

    plan = _native.prefetch_lines()
    plan_text = "whole runs" if plan == "all" else f"{plan} lines"
    assert v["cpu_kernels"] == (
        f"C (ple.kernels.native), {_native.current_isa()}, {_native.team()} threads, prefetch {plan_text}"
    )
    from ple.kernels import cpu_gemm

    assert v["cpu_gemm"] == cpu_gemm.describe() and v["cpu_gemm"].startswith(("packed oneDNN", "F.linear"))
    assert f"\nfloor: the projections' GEMM as the layer runs it here: {v['cpu_gemm']}\ngeometry: quick" in table
    s = rep["settings"]
    assert s["repeat"] == 2 and s["max_repeat"] == 2 and s["quick"] is True
    assert s["geometry"]["hidden_size"] == bench_cases.QUICK.hidden_size

    names = [c["name"] for c in rep["cases"]]
    assert names == ["ids", "prefill-long-bf16", "decode-fp32", "session-decode-bf16"]
    for c in rep["cases"]:
        assert c["status"] == "ok", c
        assert c["check"]["passed"] is True
        assert c["name"] in table
        med = c["median_ms"]
        assert med["ple"] > 0 and med["transformers"] > 0
        for key in ("ple", "transformers"):
            assert len(c["samples_ms"][key]) == 2
            xs = sorted(c["samples_ms"][key])
            assert med[key] == pytest.approx((xs[0] + xs[1]) / 2)
            assert c["min_ms"][key] == pytest.approx(xs[0])
            assert c["spread"][key] == pytest.approx(xs[1] / xs[0])
        r = c["ratios"]
        assert r["speedup_vs_transformers"] == pytest.approx(med["transformers"] / med["ple"])
        if c["name"] == "ids":
            assert med["floor"] is None and r["ple_over_floor"] is None
            assert c["aux_median_ms"]["ple_ids_unchecked"] > 0
            assert c["check"]["metrics"]["ids_differing"] == 0
        else:
            assert med["floor"] > 0
            assert r["ple_over_floor"] == pytest.approx(med["ple"] / med["floor"])
        assert c["target_met"] is None  # the targets are the published geometry's, not the quick one's
    assert "targets: the published geometry's; this geometry's ratios are not judged against them" in table
    bf16 = rep["cases"][1]
    assert bf16["dtype"] == "bf16" and bf16["targets"] == {"speedup_min": None, "floor_max": 1.3}
    assert bf16["check"]["metrics"]["max_abs_err_ple_vs_fp32"] <= bf16["check"]["metrics"]["bound"]
    decode = rep["cases"][2]
    assert decode["tokens"] == bench_cases.QUICK.decode_requests * bench_cases.QUICK.decode_steps
    assert decode["aux_median_ms"]["ple_step_metadata"] > 0
    session = next(x for x in rep["cases"] if x["name"] == "session-decode-bf16")
    assert session["aux_median_ms"]["traffic"] > 0


def test_traffic_floor_counts_the_bytes_a_step_moves():
    """Decode: every token reads K-1 state taps and writes one state column; a fresh prompt reads no
    taps and writes the window's columns once. The copy moves that many bytes (half read, half written)."""
    layer = bench_cases.Fixture(bench_cases.QUICK).layer(torch.bfloat16)
    cfg, lay = layer.config, layer.layout
    c, h, g, k = cfg.hc_hidden_size, cfg.hidden_size, lay.num_heads, cfg.ple_conv_kernel_size
    tab = layer.table.storage_dtype.itemsize
    for tokens, requests, taps in ((8, 8, k - 1), (40, 1, 0)):
        read, written = bench_cases.step_traffic(layer, tokens, requests, taps)
        ctx = requests * (cfg.ngram_size - 1) * 8
        assert read == tokens * (8 + g * 8 + g * lay.head_dim * tab + (c + h) * 2 + c * 2 + taps * c * 2) + ctx
        columns = tokens if taps else min(tokens, cfg.conv_window)
        assert written == tokens * (g * 8 + lay.embed_dim * 2 + c * 2) + columns * c * 2 + ctx
    copy = bench_cases.traffic_copy(1000)
    assert copy().numel() == 500


# ---------------------------------------------------------------------------------------------- the gate


def test_broken_layer_is_refused_and_never_timed(tmp_path, monkeypatch, capsys):
    calls = []
    original = PLELayer.forward

    def broken(self, *args, **kwargs):
        calls.append(1)
        out = original(self, *args, **kwargs)
        out[-1, 0] += 0.5  # one wrong element, well inside the tolerance of nothing
        return out

    monkeypatch.setattr(PLELayer, "forward", broken)
    out_json = tmp_path / "b.json"
    rc = _run("--quick", "--cases", "prefill-long-fp32,mixed-bf16", "--quiet", "--output", str(out_json))
    assert rc == 1
    assert len(calls) == 3  # the check's one call per case (+ mixed's warm-up history), no timed calls
    rep = json.loads(out_json.read_text())
    for c in rep["cases"]:
        assert c["status"] == "check_failed"
        assert c["check"]["passed"] is False
        assert c["median_ms"] == {"ple": None, "transformers": None, "floor": None}
        assert c["samples_ms"] == {} and c["min_ms"] == {}
        assert c["ratios"]["speedup_vs_transformers"] is None
        assert c["target_met"] is None
    table = capsys.readouterr().out
    assert table.count("REFUSED (check_failed") == 2


def test_broken_ids_are_refused(monkeypatch, capsys):
    original = ple.ngram.ngram_ids

    def off_by_one(*args, **kwargs):
        ids = original(*args, **kwargs)
        ids[ids.shape[0] // 2, 3] += 1
        return ids

    monkeypatch.setattr(ple.ngram, "ngram_ids", off_by_one)
    rc = _run("--quick", "--cases", "ids", "--quiet")
    assert rc == 1
    out = capsys.readouterr().out
    assert "REFUSED (check_failed: 1 ids differ)" in out


def test_run_case_times_nothing_after_a_failed_or_raising_check():
    counts = {"ple": 0, "transformers": 0, "floor": 0, "aux": 0}

    def counter(name):
        def fn():
            counts[name] += 1
            return torch.zeros(3)

        return fn

    def prepared(check):
        return bench_cases.Prepared(
            shape="3",
            tokens=3,
            ple=counter("ple"),
            transformers=counter("transformers"),
            check=check,
            floor=counter("floor"),
            aux={"x": counter("aux")},
        )

    case = bench_cases.CASES[1]
    fx = bench_cases.Fixture(bench_cases.QUICK)
    rec = runner.run_case(case, fx, 3, 1, prepared=prepared(lambda p, t: bench_cases.CheckResult(False, "no")))
    assert rec["status"] == "check_failed"
    assert counts == {"ple": 1, "transformers": 1, "floor": 0, "aux": 0}

    def boom(p, t):
        raise RuntimeError("kaput")

    rec = runner.run_case(case, fx, 3, 1, prepared=prepared(boom))
    assert rec["status"] == "error" and "kaput" in rec["check"]["detail"]
    assert counts == {"ple": 2, "transformers": 2, "floor": 0, "aux": 0}

    rec = runner.run_case(case, fx, 3, 1, prepared=prepared(lambda p, t: bench_cases.CheckResult(True, "ok")))
    assert rec["status"] == "ok"
    assert counts == {"ple": 3 + 4, "transformers": 3 + 4, "floor": 4, "aux": 4}  # check + warmup + repeat


def test_measure_rotates_and_adds_rounds_only_while_noisy(monkeypatch):
    script = {"a": iter([5.0, 1.0, 1.0, 1.0, 1.0, 1.0]), "b": iter([1.0] * 6)}
    order = []

    def fake_timed(fn, reset, sync):
        name = fn()
        order.append(name)
        return next(script[name])

    monkeypatch.setattr(timing, "_timed", fake_timed)
    fns = {"a": lambda: "a", "b": lambda: "b"}
    # a's first sample is 5x the others: noisy, so rounds are added up to max_repeat
    got = timing.measure(fns, repeat=2, warmup=0, max_repeat=4)
    assert got == {"a": [5.0, 1.0, 1.0, 1.0], "b": [1.0] * 4}
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # steady series stop at repeat; warm-up rounds are not kept
    script = {"a": iter([9.0, 1.0, 1.1]), "b": iter([9.0, 1.0, 1.0])}
    assert timing.measure(fns, repeat=2, warmup=1, max_repeat=5) == {"a": [1.0, 1.1], "b": [1.0, 1.0]}


def test_compare_outputs_rules():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 33, generator=g, dtype=torch.float64).float()
    tf16 = ref.bfloat16()
    # fp32: tiny differences pass, a real one fails, NaN fails
    assert bench_cases.compare_outputs(ref + 1e-6, ref, torch.float32, None).passed
    bad = ref.clone()
    bad[7, 3] += 1e-2
    assert not bench_cases.compare_outputs(bad, ref, torch.float32, None).passed
    nan = ref.clone()
    nan[0, 0] = float("nan")
    res = bench_cases.compare_outputs(nan, ref, torch.float32, None)
    assert not res.passed and "non-finite" in res.detail
    # bf16: judged against the fp32 reference; rounding like transformers passes, 3 ulps off fails
    assert bench_cases.compare_outputs(ref.bfloat16(), tf16, torch.bfloat16, lambda: ref).passed
    err_tf = float((tf16.float() - ref).abs().max())
    wrong = ref.clone()
    wrong[1, 1] += 3 * err_tf + 2e-3
    res = bench_cases.compare_outputs(wrong.bfloat16(), tf16, torch.bfloat16, lambda: ref)
    assert not res.passed, res.detail
    # shapes must agree
    assert not bench_cases.compare_outputs(ref[:-1], ref, torch.float32, None).passed


def test_targets():
    t = bench_cases.Targets(speedup_min=3, floor_max=1.3)
    assert t.met(3.0, 1.3) is True
    assert t.met(2.99, 1.0) is False
    assert t.met(5.0, 1.31) is False
    assert t.met(None, 1.0) is False
    assert bench_cases.Targets().met(1.0, 1.0) is None
    assert bench_cases.Targets(speedup_min=20).met(25.0, None) is True


def test_targets_are_the_goals_only():
    """ple / floor is the goal (what ple adds to the GEMM it cannot avoid); speed-ups against
    transformers are reported but no longer targeted."""
    assert all(c.targets.speedup_min is None for c in bench_cases.CASES)
    floors = {c.name: c.targets.floor_max for c in bench_cases.CASES if c.targets.floor_max is not None}
    assert floors["session-decode-bf16"] == 1.15 and floors["session-prefill-bf16"] == 1.1
    assert floors["session-decode-fp32"] == 1.15


def test_a_run_says_how_long_before_it_starts_and_shows_progress(capsys, monkeypatch):
    monkeypatch.setattr(runner, "ROUND_LOG_SECONDS", 0.0)  # every timing round reported
    assert _run("--quick", "--cases", "ids,decode-fp32", "--repeat", "2", "--warmup", "1") == 0
    err = capsys.readouterr().err.splitlines()
    at = {
        key: next(i for i, line in enumerate(err) if key in line)
        for key in (
            "ple bench: expected to take about",
            "ple bench: [1/2] ids",
            "ple bench: [1/2] ids finished",
            "ple bench: [2/2] decode-fp32",
            "[decode-fp32] timing round 3 of 3 done",
        )
    }
    assert list(at.values()) == sorted(at.values()), err  # the estimate first, then case by case
    assert "(one GEMM here: fp32 " in err[at["ple bench: expected to take about"]]


def test_the_estimate_scales_with_the_gemm_rate_and_says_when_bf16_is_slow(monkeypatch):
    rates = {torch.bfloat16: 1e9, torch.float32: 1e11}  # flop/s: bf16 100x slower, as without bf16 instructions
    monkeypatch.setattr(runner, "_gemm_flops_per_second", lambda geo, dtype, device: rates[dtype])
    geo = bench_cases.PUBLISHED
    chosen = bench_cases.select_cases("prefill-long-bf16,prefill-long-fp32,ids")
    est = runner.estimate_seconds(chosen, geo, torch.device("cpu"), repeat=3, warmup=1, max_repeat=5)
    gemm = 2.0 * 2048 * 2560 * (4 * 2560 + 2560)  # one prefill of 2,048 tokens through the projections
    per_round = runner.FLOORS_PER_ROUND * gemm
    assert est["cases"]["prefill-long-bf16"] == pytest.approx(per_round / 1e9 * 5)  # warm-up, 3 rounds, check
    assert est["cases"]["prefill-long-fp32"] == pytest.approx(per_round / 1e11 * 5)
    assert est["cases"]["ids"] == 0
    assert est["high_s"] == pytest.approx(est["low_s"] * 7 / 5)
    text = runner.describe_estimate(est, chosen, torch.device("cpu"))
    assert text.startswith("expected to take about 56 min to 79 min of timed runs")
    assert "bf16 GEMMs run 100x slower than fp32 here" in text and "--quick" in text


# ---------------------------------------------------------------------------------------------- selection, cli


def test_select_cases():
    names = lambda spec: [c.name for c in bench_cases.select_cases(spec)]  # noqa: E731
    assert names(None) == names("all") == [c.name for c in bench_cases.CASES]
    assert names("prefill") == ["prefill-long-bf16", "prefill-batch-bf16", "prefill-long-fp32", "prefill-batch-fp32"]
    assert names("*-bf16") == [
        "prefill-long-bf16",
        "prefill-batch-bf16",
        "decode-bf16",
        "session-decode-bf16",
        "session-prefill-bf16",
        "mixed-bf16",
    ]
    assert names("session") == ["session-decode-bf16", "session-decode-fp32", "session-prefill-bf16"]
    assert names("decode-fp32,ids,decode-fp32") == ["decode-fp32", "ids"]
    with pytest.raises(ValueError, match="no benchmark case matches 'prefil'.*known cases: ids"):
        bench_cases.select_cases("prefil")
    assert names("all") == names(None) and len(names(None)) == len(bench_cases.CASES)
    for empty in ("", " , "):
        with pytest.raises(ValueError, match=r"names no case \(say 'all' for every case\)"):
            bench_cases.select_cases(empty)


def test_bad_arguments(capsys, monkeypatch):
    # wrong values of the command line are usage errors (exit 2), whether argparse or the run finds them
    for argv in (("--repeat", "0"), ("--threads", "0"), ("--device", "bogus"), ("--warmup", "-1")):
        with pytest.raises(SystemExit) as e:
            _args("--quick", *argv)
        assert e.value.code == 2
        assert argv[0] in capsys.readouterr().err
    for argv, said in [
        (("--cases", "nope"), "no benchmark case matches 'nope'"),
        (("--repeat", "3", "--max-repeat", "2"), "need --repeat >= 1, --warmup >= 0 and --max-repeat >= --repeat"),
        (("--profile", "prefill"), "--profile needs one case"),  # matches four cases
    ]:
        assert main(["bench", "--quick", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: ple bench ") and f"ple bench: error: {said}" in err, err
        with pytest.raises(SystemExit) as e:
            runner.main(["--quick", *argv])
        assert e.value.code == 2 and said in capsys.readouterr().err
    # a GPU the machine lacks is a problem of the environment: exit 1, one line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--quick", "--cases", "ids", "--device", "cuda"]) == 1
    assert capsys.readouterr().err == "ple bench: --device cuda: CUDA is not available on this machine\n"


def test_python_dash_m_lists_cases():
    proc = subprocess.run(
        [sys.executable, "-m", "ple.commands.bench", "--list"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "PYTHONPATH": str(_REPO / "src")},
    )
    assert proc.returncode == 0, proc.stderr
    for c in bench_cases.CASES:
        assert c.name in proc.stdout


def test_list_prints_text_or_one_json_document(capsys):
    from ple.commands.cli import main

    assert main(["bench", "--list"]) == 0
    text = capsys.readouterr().out
    assert [line.split()[0] for line in text.splitlines()] == [c.name for c in bench_cases.CASES]
    assert main(["bench", "--list", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # the whole of stdout is one document
    assert doc["schema"] == runner.LIST_SCHEMA
    assert [c["name"] for c in doc["cases"]] == [c.name for c in bench_cases.CASES]
    by_name = {c["name"]: c for c in doc["cases"]}
    assert by_name["ids"]["dtype"] == "int64" and by_name["decode-fp32"]["dtype"] == "fp32"
    for case in bench_cases.CASES:
        entry = by_name[case.name]
        assert (entry["kind"], entry["description"]) == (case.kind, case.description)
        assert entry["targets"] == {"speedup_min": case.targets.speedup_min, "floor_max": case.targets.floor_max}


def test_published_geometry_matches_the_spec():
    g = bench_cases.PUBLISHED
    assert (g.hidden_size, g.hc_count, g.embed_dim, g.config.num_heads, g.config.head_dim) == (2560, 4, 2560, 16, 160)
    assert (g.conv_kernel_size, g.vocab_size, g.eos_token_id) == (4, 248320, 248044)
    assert g.ids_shape == (64, 1024) and g.prefill_long == (1, 2048) and g.prefill_batch == (8, 512)
    assert (g.decode_requests, g.decode_steps) == (64, 32)
    assert g.mixed_decode + g.mixed_prefill[0] == 64 and g.mixed_prefill[1] == 256


@pytest.mark.parametrize("geometry", [bench_cases.PUBLISHED, bench_cases.QUICK])
def test_geometry_config_is_what_transformers_is_built_with(geometry):
    """ple's side of every case reads the same config and layout as the transformers modules."""
    from ple.config import PLEConfig

    fx = bench_cases.Fixture(geometry)
    from_hf = PLEConfig.from_dict(fx.hf_config.to_dict())
    assert fx.ple_config == from_hf
    assert fx.ple_config.layout(0) == from_hf.layout(0)


# ---------------------------------------------------------------------------------------------- profile


def test_profile_quick_prints_stages(capsys):
    rc = _run("--quick", "--profile", "prefill-long-fp32", "--repeat", "1", "--warmup", "0", "--quiet")
    assert rc == 0
    out = capsys.readouterr().out
    for stage in ("checks", "ids", "lookup", "gemm", "gate+conv", "other", "ple total", "floor (projections)"):
        assert f"\n{stage} " in out, stage
    assert "torch.profiler" in out
    # the stages are ranges in the code: nothing was patched, and they cost nothing without a profiler
    from ple.ops.library import named_range

    assert named_range("ple.ids") is named_range("ple.gemm")
    with torch.profiler.profile() as prof:
        with named_range("ple.ids"):
            pass
    assert [e.name for e in prof.events()] == ["ple.ids"]


def test_profile_json_is_one_document(capsys):
    rc = _run("--quick", "--profile", "decode-fp32", "--repeat", "1", "--warmup", "0", "--quiet", "--json")
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ple-bench-profile/1" and doc["case"] == "decode-fp32" and doc["repeat"] == 1
    stages = {s["label"]: s["median_ms"] for s in doc["stages"]}
    assert {"ids", "lookup", "gemm", "gate+conv"} <= set(stages) and all(v >= 0 for v in stages.values())
    assert doc["total_ms"] > 0 and doc["other_ms"] >= 0
    assert set(doc["reference_median_ms"]) == {"transformers", "floor"}
    assert doc["operators"] and all(set(op) == {"name", "calls", "self_cpu_time_ms"} for op in doc["operators"])


def test_profile_refuses_a_failing_case(monkeypatch, capsys):
    original = PLELayer.forward
    monkeypatch.setattr(PLELayer, "forward", lambda self, *a, **k: original(self, *a, **k) * 2)
    assert _run("--quick", "--profile", "decode-fp32", "--quiet") == 1
    assert "check failed, not profiled" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the GPU check script


def test_gpu_check_script_parses_and_its_python_part_runs_on_cpu(tmp_path, monkeypatch):
    import importlib.util
    import shutil

    if shutil.which("bash"):
        proc = subprocess.run(
            ["bash", "-n", str(_REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
    spec = importlib.util.spec_from_file_location("gpu_check", _REPO / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    rc = mod.main(["--device", "cpu", "--tiny", "--repeat", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert rep["schema"] == mod.SCHEMA and not rep["errors"]
    kernels = {r["kernel"] for r in rep["records"]}
    assert kernels == {
        "ngram_ids",
        "gather",
        "gate",
        "conv",
        "engine: no host sync",
        "engine: CUDA graph decode step",
    }
    for r in rep["records"]:
        assert r["passed"], r
        if r["kernel"].startswith("engine"):
            assert "n/a on the CPU" in r["detail"]
            continue
        assert r["median_us"] > 0 and r["bytes_moved"] > 0
        assert r["fraction_of_peak_bw"] == pytest.approx(r["bytes_moved"] / (r["median_us"] * 1e-6) / 4.8e12)
    table = (tmp_path / "gpu_kernels.md").read_text().splitlines()
    assert "gather" in [line.strip().strip("|").split("|")[0].strip() for line in table if line.startswith("|")]


def test_session_cases_pass_their_checks_and_the_report_names_the_geometry(capsys):
    rc = _run("--quick", "--cases", "session", "--repeat", "1", "--warmup", "0", "--quiet")
    assert rc == 0
    out = capsys.readouterr().out
    names = [line.strip().strip("|").split("|")[0].strip() for line in out.splitlines() if line.startswith("|")]
    assert "session-decode-bf16" in names and "session-prefill-bf16" in names
    assert out.rstrip().endswith(bench_cases.QUICK.describe())
    assert bench_cases.QUICK.describe().startswith("geometry: quick (H 40, HC 4, E 48")
    assert bench_cases.PUBLISHED.describe().startswith(
        "geometry: published (H 2560, HC 4, E 2560, N 3, 16 heads of 160"
    )


def test_memory_budget_serves_ples_table_from_the_direct_tier(tmp_path, capsys):
    from ple.table import DirectTable

    fx = bench_cases.Fixture(bench_cases.QUICK, memory_budget=1 << 20)
    layer = fx.layer(torch.bfloat16)
    table = layer.table
    assert isinstance(table, DirectTable) and table.memory_budget == 1 << 20
    assert 0 < table.pinned_rows == table.cache_slots // 2  # the warm-up's hottest rows, the rest a running cache
    ids = torch.randint(0, table.rows, (64, 16), generator=torch.Generator().manual_seed(0))
    want = PLELayer.from_transformers(fx.module(torch.bfloat16)).table.lookup(ids, torch.bfloat16)
    assert torch.equal(table.lookup(ids, torch.bfloat16), want)  # the rows of transformers' table, bit for bit
    out_json = tmp_path / "b.json"
    rc = _run(
        "--quick", "--cases", "decode-bf16", "--repeat", "2", "--memory-budget", "1MiB", "--output", str(out_json)
    )
    assert rc == 0  # the case's check (against transformers, its table in memory) passed
    assert "ple's table: direct tier, memory budget 1MiB; cache hit rate bf16" in capsys.readouterr().out
    served = json.loads(out_json.read_text())["settings"]["table"]
    assert served["tier"] == "direct" and served["memory_budget_bytes"] == 1 << 20
    assert 0 < served["bf16"]["hit_rate"] < 1 and served["bf16"]["rows_read"] > 0


def _session_floor_script():
    """``benchmarks/session_floor.py`` loaded as a module."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "session_floor.py"
    spec = importlib.util.spec_from_file_location("session_floor_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_session_floor_parts_time_every_part_and_restore_what_they_wrap():
    import ple.ops.fused.native as fused_native
    from ple import PLEConfig, PLELayer, Session
    from ple.kernels import native as _native

    module = _session_floor_script()
    cfg = PLEConfig(
        hidden_size=16, hc_count=2, ple_embed_dim=16, ngram_size=3, heads_per_ngram=2, vocab_size=500,
        eos_token_id=3, ngram_vocab_size_base=300, ple_layer_ids=(1,),
    )  # fmt: skip
    layer = module.build_layer(cfg, torch.float32)
    before = (fused_native.run, PLELayer.forward, PLELayer.projections, Session._begin, Session._end)
    got = module.parts_case(layer, 3, 1)["median_s"]
    assert (fused_native.run, PLELayer.forward, PLELayer.projections, Session._begin, Session._end) == before
    native, lib = layer._native_step, _native.library()
    assert native._ids_fn is lib.ple_ngram_ids and native._gather_fn is lib.ple_gather_rows
    assert native._fused_fn is lib.ple_gate_conv  # the C functions themselves again, not the timers
    parts = ("begin", "GEMM", "engine call", "end", "step", "rest of the engine call", "beside the GEMM")
    parts += ("n-gram ids kernel", "row gather kernel", "fused gate + conv kernel")  # the session's C calls
    for part in parts:
        assert got[part] >= 0, part
    assert got["traffic"] > 0  # the copy of the step's bytes, timed beside the steps
    assert got["step"] >= got["GEMM"] and got["engine call"] >= got["GEMM"]
    assert got["engine call"] >= got["GEMM"] + got["fused gate + conv kernel"]
    prompt = module.parts_case(layer, 1, 2, prefill=9)  # a fresh request's prompt per step
    assert prompt["case"] == "parts of a prompt of 9 tokens"
    assert all(prompt["median_s"][part] >= 0 for part in parts) and prompt["median_s"]["traffic"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_session_floor_cases_check_every_way_in_against_the_others(dtype):
    """The decode and prefill cases time the floor, the engine call on prebuilt batches in both pool
    layouts, begin/run/end and Session.step, after checking that all four give the same outputs."""
    from ple import PLEConfig

    module = _session_floor_script()
    cfg = PLEConfig(
        hidden_size=16, hc_count=2, ple_embed_dim=16, ngram_size=3, heads_per_ngram=2, vocab_size=500,
        eos_token_id=3, ngram_vocab_size_base=300, ple_layer_ids=(1,),
    )  # fmt: skip
    layer = module.build_layer(cfg, dtype)
    for case in (module.decode_case(layer, 3, 2, 1), module.prefill_case(layer, 7, 1)):
        assert case["session_equals_engine"], case["case"]
        assert set(case["samples"]) == {"floor", "linear", "engine", "ring", "phases", "session", "traffic"}
        assert all(len(v) == 1 and v[0] > 0 for v in case["samples"].values())


def test_session_floor_paired_ratios_divide_each_round_by_its_own_floor():
    module = _session_floor_script()
    # the machine slows down 2x in the second half; each call is 1.1x / 1.2x / 1.3x its round's floor
    floor = [1.0, 1.0, 1.0, 2.0, 2.0]
    samples = {"floor": floor, "engine": [1.1 * f for f in floor], "phases": [1.2 * f for f in floor]}
    samples["session"] = [1.3 * f for f in floor]
    samples["ring"] = [1.05 * f for f in floor]
    got = module.paired_ratios(samples)
    assert got == pytest.approx({"engine": 1.1, "ring": 1.05, "phases": 1.2, "session": 1.3})


def test_kernel_floor_builds_and_runs_with_each_prefetch_plan(tmp_path):
    """``benchmarks/kernel_floor.c`` (the fused kernel alone against a copy of its bytes) compiles warning-free
    against the library's source, runs a small step with the plan it is given and names that plan, and
    refuses a plan below -1."""
    import shutil

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "kernel_floor"
    source = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_floor.c"
    flags = ["-O1", "-Wall", "-Wextra", "-Werror", "-fopenmp-simd", "-pthread"]
    subprocess.run([cc, *flags, "-o", str(exe), str(source), "-lm"], check=True, capture_output=True, timeout=300)
    for plan, said in (("0", "prefetch 0 lines"), ("3", "prefetch 3 lines"), ("9223372036854775807", "whole runs")):
        out = subprocess.run(
            [str(exe), "1", "4", "1", "0", "3", "0", plan], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        assert said in out.stdout and "kernel / floor" in out.stdout, out.stdout
    for layout, said in (("0", "bf16, ring, 4 tokens"), ("1", "bf16, engine layout, 4 tokens")):
        out = subprocess.run(
            [str(exe), "1", "4", "1", "0", "3", "0", "-1", layout], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0 and said in out.stdout, out.stdout + out.stderr
    bad = subprocess.run([str(exe), "1", "4", "1", "0", "3", "0", "-5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "bad arguments" in bad.stderr
    # two threads: started per call in this build; an OpenMP team in the documented -fopenmp build
    out = subprocess.run([str(exe), "0", "4", "2", "0", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "4 tokens, 2 threads (threads started per call)" in out.stdout and "wall: kernel" in out.stdout, out.stdout
    team = tmp_path / "kernel_floor_omp"
    flags[flags.index("-fopenmp-simd")] = "-fopenmp"
    built = subprocess.run(
        [cc, *flags, "-o", str(team), str(source), "-lm"], capture_output=True, text=True, timeout=300
    )
    if built.returncode != 0 and "openmp" in built.stderr.lower():
        pytest.skip(f"this compiler builds no OpenMP: {built.stderr.strip()[:200]}")
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(team), "0", "4", "2", "0", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "4 tokens, 2 threads (an OpenMP team)" in out.stdout and "wall: kernel" in out.stdout, out.stdout


def test_session_floor_without_gemm_caches_both_gemms(monkeypatch):
    """``--without-gemm`` caches ``F.linear`` and the packed GEMM alike: the projections then cost a lookup."""
    import torch.nn.functional as F

    from ple import PLEConfig
    from ple.kernels import cpu_gemm

    module = _session_floor_script()
    monkeypatch.setattr(F, "linear", F.linear)  # restored after the test: without_gemm() replaces both
    monkeypatch.setattr(cpu_gemm, "linear", cpu_gemm.linear)
    monkeypatch.setenv("PLE_PACKED_GEMM", "on" if cpu_gemm.missing() is None else "off")
    cfg = PLEConfig(
        hidden_size=16, hc_count=2, ple_embed_dim=16, ngram_size=3, heads_per_ngram=2, vocab_size=500,
        eos_token_id=3, ngram_vocab_size_base=300, ple_layer_ids=(1,),
    )  # fmt: skip
    layer = module.build_layer(cfg, torch.bfloat16)
    module.without_gemm()
    for rows in (3, cpu_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, 16).bfloat16()
        first = layer.projections(x)
        assert layer.projections(torch.randn(rows, 16).bfloat16()) is first  # cached per shape


@pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="no oneDNN")
@pytest.mark.parametrize("limit, takes", [(255, "no"), (None, "yes")])
def test_packed_gemm_script_prints_a_row_per_count(capsys, monkeypatch, limit, takes):
    import importlib.util

    from ple.kernels import cpu_gemm

    monkeypatch.setenv("PLE_PACKED_GEMM", "on")
    monkeypatch.setattr(cpu_gemm, "max_rows", lambda: cpu_gemm.ALL_ROWS if limit is None else limit)

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "packed_gemm.py"
    spec = importlib.util.spec_from_file_location("packed_gemm_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--rows", "1,300", "--out", "48", "--in", "32", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 300 |")]
    assert len(lines) == 2 and lines[0].endswith("| yes |") and lines[1].endswith(f"| {takes} |"), out
    assert "the layer's GEMM here" in out
    with pytest.raises(SystemExit):
        module.main(["--rows", "0"])


def test_the_parallel_benchmark_checks_its_output_before_the_work(tmp_path, capsys):
    """``python -m ple.commands.bench.parallel --output`` in a missing folder: refused at once (exit 2),
    before any rank is spawned."""
    from ple.commands.bench import parallel

    with pytest.raises(SystemExit) as e:
        parallel.main(["--ranks", "2", "--output", str(tmp_path / "missing" / "x.json")])
    assert e.value.code == 2
    assert f"--output {tmp_path / 'missing' / 'x.json'}: its folder" in capsys.readouterr().err
