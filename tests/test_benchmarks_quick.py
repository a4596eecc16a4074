"""The benchmark scripts' quick modes run end to end and write what their RESULTS.md tables read.

They measure (time, memory); nothing here asserts a timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_step_overhead_quick(tmp_path):
    out = tmp_path / "step_overhead.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_overhead.py"), "--quick",
                          "--precisions", "fp32", "--out", str(out)],  # bf16 runs 6-23x slower on CPU
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["models"]) == {"tiny"}
    tiny = data["models"]["tiny"]
    assert tiny["shapes"]["action_tokens"] == 4 * 128 and tiny["shapes"]["student_tokens"] == 4 * 256
    assert tiny["shapes"]["teacher_tokens"] > tiny["shapes"]["student_tokens"]  # reference block + latents
    assert set(tiny["summary"]) == {"fp32"}
    for prec in ("fp32",):
        s = tiny["summary"][prec]
        assert set(s["seconds"]) == {"sft", "student", "lopd", "lopd_share", "lopd_off", "enc_fwd", "enc_fwdbwd",
                                     "head_pass"}
        assert all(v > 0 for v in s["seconds"].values())
        assert s["ratio_to_sft"]["sft"] == 1.0
        assert {"student", "lopd"} <= set(s["over_floor"])
        assert {"teacher", "student", "composer"} <= set(s["lopd_phase_seconds"])
        assert len(tiny["timing"][prec]["runs"]["lopd"]) == 2
    mem = tiny["summary"]["fp32"]["memory"]
    assert {"sft", "student", "lopd", "lopd_share", "lopd_off"} <= set(mem)
    for phase in mem.values():
        assert phase["peak_rss_mib"] >= phase["setup_peak_rss_mib"] > 0
    assert "| fp32 | lopd |" in res.stdout


def _benchmark_module(name: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


@pytest.mark.slow
def test_sample_efficiency_quick(tmp_path):
    se = _benchmark_module("sample_efficiency")
    out = tmp_path / "out"
    # The methods whose orchestration differs (bank or not, composer or not, SFT -> LOPD's warm
    # start); opsd, lopd_margin0 and lopd_frozen are recipe overrides of the same paths (kept out
    # for the suite's time; the full study runs them).
    methods = ["lopd", "grpo", "sft", "sft_lopd"]
    data = se.main(["--quick", "--work", str(tmp_path / "work"), "--out", str(out), "--methods", *methods,
                    "--method-budget", "sft_lopd=16"])

    saved = json.loads((out / "sample_efficiency.json").read_text())
    assert saved["partial"] is False and saved == json.loads(json.dumps(data))
    assert (out / "sample_efficiency.png").stat().st_size > 0
    assert (out / "sample_efficiency_report.png").stat().st_size > 0
    B, bank, R = saved["budget"], saved["bank_rollouts"], saved["rollouts_per_step"]
    assert set(saved["methods"]) == set(methods)
    runs = {r["method"]: r for r in saved["runs"]}
    assert len(runs) == len(saved["runs"])  # sft ran once, though sft_lopd needs it too
    for run in saved["runs"]:
        prior = saved["bank"]["0"]["added"] if run["method"] in se.USES_BANK else 0
        curve = run["curve"]
        # every rollout counted: the bank methods' curves start after bank filling, and the
        # trainer's own counter ends at prior + steps × R, never past B; SFT spends none
        spent = 0 if run["method"] == "sft" else run["steps"] * R
        assert curve[0]["rollouts"] == prior
        assert curve[-1]["rollouts"] == prior + spent <= B
        assert all(0.0 <= p["success"] <= 1.0 for p in curve)
    # --method-budget: sft_lopd stops at its own, smaller budget (the quick bank is 8, R is 4)
    assert runs["sft_lopd"]["budget"] == 16 and runs["sft_lopd"]["steps"] == (16 - bank) // R
    assert runs["lopd"]["budget"] == B and runs["lopd"]["steps"] == (B - bank) // R
    lopd_curve = saved["methods"]["lopd"]["curve"]
    assert [p["rollouts"] for p in lopd_curve] == [p["rollouts"] for p in runs["lopd"]["curve"]]
    assert lopd_curve[-1]["success_mean"] == runs["lopd"]["curve"][-1]["success"] and lopd_curve[-1]["seeds"] == 1
    # SFT -> LOPD starts where SFT ended
    assert runs["sft_lopd"]["curve"][0]["success"] == runs["sft"]["curve"][-1]["success"]
    assert saved["team_logs"]["0"]["successes"] > 0
    assert set(saved["budget_fraction_to_grpo_final"]["methods"]) == set(methods)
    for m in saved["methods"].values():
        assert 0.0 <= m["final_success_mean"] <= 1.0 and m["seeds"] == [0]
    frac = saved["lopd_fraction_of_budget_to_grpo_final"]
    assert frac["seeds"] == 1
    assert frac["per_seed"][0] is None or 0.0 <= frac["per_seed"][0] <= 1.0


def test_sample_efficiency_crossing_budget_interpolates():
    se = _benchmark_module("sample_efficiency")
    curve = [(64, 0.2), (128, 0.4), (192, 0.6)]
    assert se.crossing_budget(curve, 0.5) == pytest.approx(160)
    assert se.crossing_budget(curve, 0.1) == 64
    assert se.crossing_budget(curve, 0.7) is None


@pytest.mark.slow
def test_rollout_throughput_quick(tmp_path):
    rt = _benchmark_module("rollout_throughput")
    out = tmp_path / "rollout.json"
    data = rt.main(["--quick", "--models", "tiny", "--backends", "hf", "--n", "4", "--max-new-tokens", "8",
                    "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    rows = {r["path"]: r for r in data["rows"]}
    assert set(rows) == {"bare generate", "runner hf"}
    bare, runner = rows["bare generate"], rows["runner hf"]
    # one batch, same seed and sampling settings: the runner generates exactly the bare loop's tokens
    assert 4 <= bare["tokens"] == runner["tokens"] <= 4 * 8
    assert bare["ratio_to_bare"] == 1.0
    assert runner["tok_s"] > 0 and runner["ratio_to_bare"] == pytest.approx(runner["tok_s"] / bare["tok_s"])


def _study_file(path: Path, seed: int, lopd_final: float, grpo_final: float, budget: int = 96) -> Path:
    """A sample_efficiency.json as one process (one seed) of the study writes it."""
    base = {"success": 0.1, "n": 8, "reward": 0.3}
    runs = [
        {"method": "lopd", "seed": seed, "steps": 2, "run_dir": str(path / "lopd"), "train_seconds": 1.0,
         "curve": [{"rollouts": 32, "step": 0, **base}, {"rollouts": 96, "step": 2, "success": lopd_final, "n": 8}]},
        {"method": "grpo", "seed": seed, "steps": 3, "run_dir": str(path / "grpo"), "train_seconds": 1.0,
         "curve": [{"rollouts": 0, "step": 0, **base}, {"rollouts": 96, "step": 3, "success": grpo_final, "n": 8}]},
    ]
    data = {"partial": False, "budget": budget, "bank_rollouts": 32, "rollouts_per_step": 32, "eval_split": "test",
            "eval_n": 8, "runs": runs, "bank": {str(seed): {"added": 32, "successes": 5}},
            "command": f"sample_efficiency.py --seeds {seed}", "elapsed_s": 10.0}
    path.mkdir(parents=True)
    (path / "sample_efficiency.json").write_text(json.dumps(data))
    return path / "sample_efficiency.json"


def test_sample_efficiency_merges_per_seed_processes(tmp_path):
    se = _benchmark_module("sample_efficiency")
    a = _study_file(tmp_path / "s0", 0, lopd_final=0.5, grpo_final=0.2)
    b = _study_file(tmp_path / "s1", 1, lopd_final=0.35, grpo_final=0.4)
    out = tmp_path / "merged"
    data = se.main(["--merge", str(a), str(b), "--out", str(out), "--no-report"])

    saved = json.loads((out / "sample_efficiency.json").read_text())
    assert saved["methods"]["lopd"]["seeds"] == [0, 1] and saved["methods"]["grpo"]["seeds"] == [0, 1]
    assert saved["methods"]["lopd"]["final_success_mean"] == pytest.approx(0.425)
    # t interval over two seeds: 12.706 * sd / sqrt(2), sd of (0.5, 0.35) = 0.10607
    assert saved["methods"]["lopd"]["final_success_ci95"] == pytest.approx(12.706 * 0.10607 / 2 ** 0.5, rel=1e-3)
    frac = saved["lopd_fraction_of_budget_to_grpo_final"]
    assert frac["target_grpo_final_success"] == pytest.approx(0.3)
    # linear between checkpoints: seed 0 crosses 0.3 halfway up 32 -> 96 (0.1 -> 0.5), seed 1
    # four fifths up it (0.1 -> 0.35)
    assert frac["per_seed"] == pytest.approx([64 / 96, (32 + 64 * 0.8) / 96])
    assert set(saved["bank"]) == {"0", "1"} and saved == json.loads(json.dumps(data))
    assert (out / "sample_efficiency.png").stat().st_size > 0

    # a longer GRPO run of seed 0 (another file, larger budget) replaces the first one, and the
    # fractions are of GRPO's rollouts
    longer = _study_file(tmp_path / "g0", 0, lopd_final=0.0, grpo_final=0.4, budget=192)
    d = json.loads(longer.read_text())
    d["runs"] = [r for r in d["runs"] if r["method"] == "grpo"]
    d["runs"][0]["curve"][-1]["rollouts"] = 192
    longer.write_text(json.dumps(d))
    data = se.main(["--merge", str(a), str(b), str(longer), "--out", str(tmp_path / "m2"), "--no-report"])
    grpo = {r["seed"]: r for r in data["runs"] if r["method"] == "grpo"}
    assert len(data["runs"]) == 4 and grpo[0]["budget"] == 192 and grpo[0]["curve"][-1]["rollouts"] == 192
    assert data["budget"] == 192 and len(data["replaced_runs"]) == 1
    frac = data["lopd_fraction_of_budget_to_grpo_final"]
    assert frac["target_grpo_final_success"] == pytest.approx(0.4)  # (0.4 + 0.4) / 2
    # seed 0's LOPD crosses 0.4 three quarters up 32 -> 96; GRPO's finals cost (192 + 96) / 2 rollouts
    assert frac["per_seed"] == pytest.approx([80 / 144, None])

    c = _study_file(tmp_path / "s2", 2, 0.1, 0.1)
    d = json.loads(c.read_text())
    d["eval_n"] = 16
    c.write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="eval_n"):
        se.main(["--merge", str(a), str(c), "--out", str(tmp_path / "bad"), "--no-report"])


@pytest.mark.slow
def test_coldstart_nll_quick(tmp_path):
    out = tmp_path / "coldstart_nll.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "coldstart_nll.py"), "--quick",
                          "--out", str(tmp_path / "proj"), "--json-out", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bank_rollouts"] == 8 and data["steps"] == 2 and data["heldout_examples"] == 2
    modes = ("learned", "random", "zeros", "shuffled", "text", "none")
    assert all(0 < data[f"nll_{m}"] < 20 for m in modes) and len({data[f"nll_{m}"] for m in modes}) == 6
    # The script rescores the held-out split with the saved composer: the cold start's own last validation figure.
    assert abs(data["nll_learned"] - data["val_nll_logged"]) < 1e-3
    assert data["latent_task_spread_before"] > 0 and data["latent_task_spread"] > 0


def test_bf16_cpu_quick(tmp_path):
    from lopd_cli.runtime import cpu_has_fast_bf16

    out = tmp_path / "bf16.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bf16_cpu.py"), "--quick", "--repeats", "2",
                          "--json-out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["fast_bf16"] == cpu_has_fast_bf16()
    lin = data["linear_576x1536"]
    assert lin["tokens"] == 512
    assert all(lin[k] > 0 for k in ("fp32_fwd_s", "fp32_fwd_bwd_s", "bf16_autocast_fwd_s", "bf16_autocast_fwd_bwd_s"))
    ratios = data["slowdown_bf16_over_fp32"]
    assert set(ratios) == {"linear_fwd", "linear_fwd_bwd", "tiny_forward"}
    assert ratios["linear_fwd_bwd"] == pytest.approx(lin["bf16_autocast_fwd_bwd_s"] / lin["fp32_fwd_bwd_s"])
    tiny = data["tiny_forward_256"]
    assert ratios["tiny_forward"] == pytest.approx(tiny["bfloat16_fwd_s"] / tiny["float32_fwd_s"])


@pytest.mark.slow
def test_real_model_bfcl_quick(tmp_path):
    pytest.importorskip("bfcl_eval")
    out = tmp_path / "bfcl.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_model_bfcl.py"), "--quick",
                          "--work", str(tmp_path / "w"), "--json-out", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bank"]["records"] == data["bank"]["reward_1"] > 0  # every reference answer passes the checker
    assert data["train"]["steps"] == 1 and data["train"]["rollouts_total"] == 2
    labels = [m["label"] for m in data["eval"]["models"]]
    assert labels[0].startswith("backbone") and labels[1].startswith("lopd/step_1")
    assert all(m["n"] == 4 and m["errors"] == 0 for m in data["eval"]["models"])


def test_real_model_bfcl_refuses_a_work_folder_it_did_not_make(tmp_path):
    pytest.importorskip("bfcl_eval")
    real_model_bfcl = _benchmark_module("real_model_bfcl")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not made by this script"):
        real_model_bfcl.main(["--quick", "--work", str(tmp_path)])
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_signoffs_counts_each_store_by_rule_set():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from signoffs import count_signoffs

    from lopd_cli.envs.orders import RECIPE_RULES_SEED, store_rules
    from lopd_cli.train.base_policy import BASE_POLICY_RULES_SEED

    recipe, base = store_rules(RECIPE_RULES_SEED)["Cedar"], store_rules(BASE_POLICY_RULES_SEED)["Cedar"]
    assert recipe["sign_off"] != base["sign_off"]

    def rec(answer, reward):
        return json.dumps({"instruction": "[Cedar] Please cancel order 3.", "reward": reward, "messages": [
            {"role": "user", "content": "[Cedar] Please cancel order 3."},
            {"role": "assistant", "content": f"Order 3 is cancelled. {answer}"}]})

    got = count_signoffs([rec(recipe["sign_off"], 1.0), rec(base["sign_off"], 0.8), rec("", 0.6)])
    assert got == {"Cedar": {"tasks": 3, "success": 1, "recipe": 1, "base": 1, "other": 0, "none": 1}}


def test_paired_success_matches_tasks_and_counts_discordant_ones(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import paired_success

    def write(name, rewards):
        p = tmp_path / name
        p.write_text("".join(json.dumps({"task_id": t, "reward": r}) + "\n" for t, r in rewards.items()))
        return p

    base = write("a.jsonl", {"t1": 1.0, "t2": 0.0, "t3": 0.0, "t4": 1.0})
    other = write("b.jsonl", {"t4": 0.5, "t3": 1.0, "t2": 1.0, "t1": 1.0, "t9": 1.0})  # other order, t9 unmatched
    (row,) = paired_success.main([str(base), str(other), "--json"])
    assert row["n"] == 4 and row["only_other"] == 2 and row["only_base"] == 1
    assert row["diff"] == pytest.approx(0.25) and row["ci95"][0] < 0.25 < row["ci95"][1]
    (row,) = paired_success.main([str(base), str(other), "--threshold", "0.5", "--json"])
    assert row["only_base"] == 0 and row["diff"] == pytest.approx(0.5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "t1"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: not a rollout record"):
        paired_success.main([str(base), str(bad)])


def test_retention_sign_test_is_the_exact_two_sided_binomial():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import retention_study as rs

    assert rs.sign_test(5, 0) == rs.sign_test(0, 5) == pytest.approx(2 / 2**5)
    assert rs.sign_test(24, 10) == pytest.approx(0.0243065, abs=1e-6)  # 2·P(X ≤ 10), X ~ Bin(34, 1/2)
    assert rs.sign_test(7, 4) == pytest.approx(0.548828125)
    assert rs.sign_test(10, 10) == rs.sign_test(0, 0) == 1.0


def test_retention_retest_without_a_study_makes_no_folder(tmp_path):
    out = tmp_path / "none"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "retention_study.py"), "retest",
                          "--project", str(tmp_path / "p"), "--out", str(out)], capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.strip() == f"{out}: no study.json and start.json here (run `run` first)"
    assert not out.exists()


def test_retention_plots_pair_the_two_retests_and_name_runs_that_share_a_spot(tmp_path):
    rs = _benchmark_module("retention_study")
    iv = lambda m: {"mean": m, "low": m - 0.01, "high": m + 0.01, "n": 128}  # noqa: E731
    run = lambda arm, seed, world, m, retested=True: {"arm": arm, "seed": seed, "retested": retested,  # noqa: E731
                                                      **({f"{world}_vs_start": iv(m)} if retested else {})}
    target = {"runs": [run("sft", 0, "target", 0.1), run("lopd", 0, "target", 0.0), run("grpo", 0, "target", 0.0),
                       run("sdpo", 0, "target", 0.02, retested=False)]}
    retain = {"runs": [run("sft", 0, "retain", -0.05), run("lopd", 0, "retain", 0.0), run("grpo", 0, "retain", 0.0),
                       run("sdpo", 0, "retain", 0.0)]}
    points = rs.retest_points(target, retain)
    assert [(p["arm"], round(p["x"], 6), round(p["y"], 6)) for p in points] == [("sft", 10.0, -5.0), ("lopd", 0.0, 0.0),
                                                                                  ("grpo", 0.0, 0.0)]
    assert rs.shared_spots(points) == {(0.0, 0.0): ["grpo s0", "lopd s0"]}

    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="no study.json"):
        rs.replot(out)
    out.mkdir()
    study = {"n_test": 64, "runs": [{"arm": r["arm"], "seed": 0, "target_vs_start": iv(0.0), "retain_vs_start": iv(0.0)}
                                    for r in target["runs"]]}
    (out / "study.json").write_text(json.dumps(study))
    (out / "retest-n128.json").write_text(json.dumps(target))
    assert rs.replot(out) == [out / "study.png"]  # one world retested: no retest plot yet
    (out / "retest-retain-n128.json").write_text(json.dumps(retain))
    assert rs.replot(out) == [out / "study.png", out / "retest-n128.png"]
    assert all(p.stat().st_size > 0 for p in rs.replot(out))
