"""Smoke test of the benchmark scripts: each runs on a minimal setting (tiny model, 1 iteration)
through its command line and writes the JSON it promises. The benchmarks themselves are not run
in CI; this only keeps them working."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def bench(script: str, *flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, f"benchmarks/{script}", *flags], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    return out


def load(path: Path) -> dict:
    assert path.exists(), path
    if HAS_MPL and path.name.endswith(".json") and "gpu" not in path.name:
        assert path.with_suffix(".png").exists()
    return json.loads(path.read_text())


def test_learning(tiny_model, tmp_path):
    out = tmp_path / "learning.json"
    bench("learning.py", "--preset", "smoke", "--model", tiny_model, "--env", "cooking", "--seeds", "1",
          "--out", str(out), "--runs-dir", str(tmp_path / "runs"))
    r = load(out)
    assert r["ok"] and r["seeds"] == [1] and r["setting"]["iterations"] == 1
    run = r["runs"]["1"]
    assert [row["iteration"] for row in run["train"]] == [1]
    row = run["train"][0]
    assert 0 <= row["valid_action_rate"] <= 1 and 0 <= row["success_rate"] <= 1
    assert row["return_with_penalty"] <= row["return"]
    assert run["eval_before"] is not None and run["eval_after"] is not None and run["eval_after_iteration"] == 1
    assert set(r["mean_curves"]) >= {"valid_action_rate", "return", "success_rate"}
    assert "--learning-rate" in run["command"] and "grpo.py" in run["command"]


def test_overhead(tiny_model, tmp_path):
    out = tmp_path / "overhead.json"
    bench("overhead.py", "--model", tiny_model, "--methods", "gigpo", "--iterations", "1", "--num-tasks", "1",
          "--group-size", "2", "--max-steps", "2", "--max-new-tokens", "8", "--out", str(out), "--runs-dir", str(tmp_path / "runs"))
    r = load(out)
    assert r["ok"] and "grpo" in r["runs"]
    base = r["runs"]["grpo"]
    assert base["iteration_s"] > 0 and base["prompt_tokens"] > 0 and base["generated_tokens"] > 0 and base["peak_rss_mb"] > 0
    if (REPO / "gigpo.py").exists():
        (c,) = r["comparisons"]
        assert c["method"] == "gigpo" and c["baseline"] == "grpo"
        for key in ("iteration_time_ratio", "generated_tokens_ratio", "prompt_tokens_ratio", "peak_memory_ratio"):
            assert c[key] is not None and c[key] > 0, key


def test_profile(tiny_model, tmp_path):
    out = tmp_path / "profile.json"
    bench("profile_iteration.py", "--model", tiny_model, "--env", "cooking", "--iterations", "1", "--num-tasks", "1",
          "--group-size", "2", "--max-steps", "2", "--max-new-tokens", "8", "--out", str(out), "--runs-dir", str(tmp_path / "runs"))
    r = load(out)
    assert r["ok"] and len(r["iterations"]) == 1
    it = r["iterations"][0]
    assert sum(it["seconds"].values()) == pytest.approx(it["iteration_s"], rel=0.05)
    assert it["seconds"]["generation"] > 0 and it["seconds"]["update"] > 0
    assert 0 < r["mean_computed_frac"] <= 1


def test_gpu_model_on_cpu(tiny_model, tmp_path):
    """benchmarks/gpu_model.py's code paths at a tiny shape on CPU (the GPU run uses the 1.5B shape)."""
    model = tmp_path / "model"
    bench("gpu_model.py", "build", "--shape", "tiny", "--out", str(model))
    assert (model / "config.json").exists() and json.loads((model / "config.json").read_text())["vocab_size"] == 151936
    out = tmp_path / "gpu_update.json"
    bench("gpu_model.py", "bench", "--model", str(model), "--samples", "4", "--prompt-tokens", "32", "--response-tokens", "8",
          "--minibatch-size", "2", "--gen-batch", "2", "--gen-prompt-tokens", "8", "--gen-new-tokens", "4", "--out", str(out))
    r = load(out)
    assert r["params"] > 0 and r["update_tokens_per_s"] > 0 and r["mfu"] > 0 and r["optimizer_steps"] == 2
    assert r["generation"]["generated_tokens"] > 0 and r["peak_flops_assumed"] == 989e12
    out = tmp_path / "gpu_iteration.json"
    bench("gpu_model.py", "iteration", "--model", tiny_model, "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
          "--flags=--env cooking --total-iterations 1 --num-tasks 1 --group-size 2 --max-steps 1 --max-new-tokens 4 "
          "--num-eval-tasks 1 --num-env-workers 1 --no-gradient-checkpointing")
    r = load(out)
    assert r["ok"] and r["perf"]["perf/iteration_s"] > 0


def test_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=REPO).returncode == 0
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stdout


def test_inspect_policy_counts_the_answers_it_samples(tiny_model, tmp_path):
    out = tmp_path / "answers.json"
    bench("inspect_policy.py", tiny_model, "--env", "cooking", "--num-games", "2", "--samples", "3", "--max-new-tokens", "8",
          "--out", str(out))
    r = json.loads(out.read_text())
    assert r["answers_sampled"] == 6 == sum(n for _, n in r["actions"])
    # the random model's answers carry no `<action>` tags: each is sent as its raw tail and is invalid
    assert r["valid_fraction"] == 0.0 and all(text.startswith("<think>") for text, _ in r["answers"])


def test_compare_runs_sft_then_each_script_and_resumes_without_rerunning(tiny_model, tmp_path, monkeypatch):
    out, runs = tmp_path / "compare.json", tmp_path / "runs"
    flags = ["--stage", "warm", "--model", tiny_model, "--env", "cooking", "--seeds", "1", "--methods", "grpo.py",
             "--sft-num-tasks", "1", "--sft-epochs", "1", "--sft-num-eval-tasks", "1", "--iterations", "1", "--num-tasks", "1", "--group-size", "2",
             "--max-steps", "2", "--max-new-tokens", "8", "--num-eval-tasks", "1", "--eval-every", "1",
             "--extra-flags=--no-gradient-checkpointing --num-env-workers 1 --bf16 False --vllm False", "--out", str(out), "--runs-dir", str(runs)]
    bench("compare.py", *flags, timeout=900)
    r = load(out)
    assert r["sft"]["eval_success"][0][0] == 0 and "sft.py" in r["sft"]["command"]
    (warm,) = r["runs"]
    assert (warm["start"], warm["script"], warm["seed"]) == ("sft", "grpo.py", 1)
    assert [i for i, _ in warm["eval_success"]] == [0, 1] and [i for i, _ in warm["train_success"]] == [1]
    assert "--invalid-penalty 0.0 " in warm["command"] and "--num-eval-tasks 1 " in r["sft"]["command"]
    assert str(runs / "warm-start") in warm["command"] and warm["iteration_s"] > 0 and warm["prompt_tokens"][0][1] > 0
    assert [i for i, _ in warm["policy"]["losses/entropy"]] == [1] and warm["policy"]["losses/entropy"][0][1] > 0
    # runs may come from different CPUs
    assert warm["generation"] == "hf"  # the sampler its flags named (--extra-flags here)
    assert warm["machine"]["cpus"] == os.cpu_count() and "cpu_bf16" in warm["machine"] and "cpu" in warm["machine"]
    assert warm["warm_start"]["run_dir"] == r["sft"]["run_dir"] and warm["warm_start"]["nll"] == r["sft"]["nll"]  # and warm starts
    (row,) = r["table"]
    assert row["script"] == "grpo.py" and row["time_ratio_to_grpo"] == 1.0 and row["change_per_seed"] == [
        warm["eval_success"][-1][1] - warm["eval_success"][0][1]]
    # a second call, reusing the finished sft.py run, finds the grpo.py run finished: it launches nothing
    sft_run = Path(r["sft"]["run_dir"])
    again = bench("compare.py", *flags, "--sft-run", str(sft_run), timeout=300)
    assert " ... -> " not in again.stdout and len(load(out)["runs"]) == 1
    typed = load(out)["sft"]["command"].split()  # rebuilt from args.json, it must parse: tyro booleans are --x/--no-x,
    assert "--no-vllm-sleep" in typed and "--torch-deterministic" in typed and "--no-track" in typed
    assert typed[typed.index("--bf16") + 1] == "False" and typed[typed.index("--vllm") + 1] == "False"  # Optional[bool]: --bf16 False
    assert typed.count("False") == 2 and "True" not in typed
    # one more iteration resumes that run in its own folder, and its entry reads that folder's metrics
    bench("compare.py", *[("2" if f == "1" and flags[k - 1] == "--iterations" else f) for k, f in enumerate(flags)], timeout=600)
    (warm,) = load(out)["runs"]
    assert [i for i, _ in warm["eval_success"]] == [0, 1, 2] and [i for i, _ in warm["train_success"]] == [1, 2]
    assert warm["run_dir"] == r["runs"][0]["run_dir"]
    # each evaluation's per-game outcomes and each iteration's training tasks are logged, and they are the lists
    # heldout_plans.py redraws with the scripts' own generators (the resumed iteration included)
    spec = importlib.util.spec_from_file_location("heldout_plans", REPO / "benchmarks" / "heldout_plans.py")
    plans = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "heldout_plans", plans)  # its dataclass looks its module up
    spec.loader.exec_module(plans)
    import envs

    held_out, trained, _ = plans.drawn_lists(envs.load("cooking"), 1, plans.Args(num_eval_tasks=1, num_tasks=1, iterations=2))
    assert warm["trained_tasks"] == {"1": trained[:1], "2": trained[1:]}
    assert list(warm["eval_won_by_task"]) == ["0", "1", "2"]
    assert all(list(games) == held_out and set(games.values()) <= {0, 1} for games in warm["eval_won_by_task"].values())
    # on a fresh machine the run folder is gone: a run compare.json holds to its last iteration with the same flags
    # is kept, not rerun (the warm start's path may differ: a rebuilt one lands in a new folder)
    import shutil

    shutil.rmtree(Path(warm["run_dir"]).parent)
    two = [("2" if f == "1" and flags[k - 1] == "--iterations" else f) for k, f in enumerate(flags)]
    kept = bench("compare.py", *two, "--sft-run", str(sft_run), timeout=300)
    assert "kept: sft grpo.py seed 1" in kept.stdout and " ... -> " not in kept.stdout and load(out)["runs"] == [warm]
    # `--stage report` summarises what landed under the setting it ran with, not the flags of the report call
    bench("compare.py", *flags[2:], "--stage", "report", "--learning-rate", "0.5", timeout=300)
    assert load(out)["setting"]["learning_rate"] == 1e-5 and load(out)["table"][0]["script"] == "grpo.py"


def test_compare_tests_start_against_end_with_fisher_exact_on_the_same_games(monkeypatch):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)
    # by hand: 0/3 against 3/3, 3 wins in 6 games; splits (0,3) and (3,0) each have C(3,0)C(3,3)/C(6,3) = 1/20, the others 9/20
    assert module.fisher_exact_p(0, 3, 3) == pytest.approx(0.1)
    assert module.fisher_exact_p(1, 2, 3) == pytest.approx(1.0)  # 9/20 + the three splits at most as likely: all of them
    assert module.fisher_exact_p(2, 0, 2) == pytest.approx(1 / 3)  # 2 wins in 4: (2,0) and (0,2) each 1/6
    rows = module.table({"setting": {"num_eval_tasks": 3}, "runs": [
        {"script": "grpo.py", "start": "sft", "seed": s, "eval_success": [[0, 0.0], [6, e]], "train_success": [[6, 0.5]],
         "iteration_s": 10.0, "prompt_tokens": [[1, 5]], "response_tokens": [[1, 1]]} for s, e in ((1, 1.0), (2, 1 / 3))]})
    assert rows[0]["fisher_p_per_seed"] == pytest.approx([0.1, 1.0]) and "+1.000 (p 0.1)" in module.markdown(rows)


def test_compare_record_keeps_runs_another_call_wrote_meanwhile(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)
    out = tmp_path / "compare.json"
    run = lambda script, start, seed, e: {"script": script, "start": start, "seed": seed, "eval_success": [[0, e]]}  # noqa: E731
    out.write_text(json.dumps({"runs": [run("grpo.py", "sft", 1, 0.1)]}))
    mine, theirs = module.load(out), module.load(out)  # two compare.py calls (warm and cold stage) load the same file
    module.record(theirs, run("grpo.py", "cold", 1, 0.0), out)
    module.record(mine, run("grpo.py", "sft", 1, 0.3), out)  # replaces its own earlier grpo.py result, keeps the cold run
    module.record(mine, run("pats.py", "sft", 2, 0.2), out)
    written = json.loads(out.read_text())["runs"]
    runs = {(r["script"], r["start"], r["seed"]): r["eval_success"] for r in written}
    assert len(written) == 3 and runs == {("grpo.py", "sft", 1): [[0, 0.3]], ("grpo.py", "cold", 1): [[0, 0.0]], ("pats.py", "sft", 2): [[0, 0.2]]}


def test_compare_keeps_a_recorded_run_only_with_the_same_flags_to_the_last_iteration(monkeypatch):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)
    entry = {"script": "gigpo.py", "start": "sft", "seed": 3, "train_success": [[1, 0.0], [2, 0.25]],
             "command": "python gigpo.py --model /old/warm/model --env cooking-easy --seed 3 --learning-rate 1e-05 --vllm True"}
    result = {"runs": [entry]}
    flags = ["--model", "/new/warm/model", "--env", "cooking-easy", "--seed", "3", "--learning-rate", "1e-05", "--vllm", "True"]
    key = ("gigpo.py", "sft", 3, "")
    assert module.recorded(result, key, flags, 2) is entry  # another warm start folder, every other flag the same
    assert module.recorded(result, key, flags, 4) is None  # it stopped at iteration 2
    assert module.recorded(result, key, [f if f != "1e-05" else "2e-05" for f in flags], 2) is None  # another setting
    assert module.recorded(result, key, flags[:-2], 2) is None  # a flag fewer
    assert module.recorded(result, ("gigpo.py", "sft", 3, "base-gigpo"), flags, 2) is None  # another variant
    assert module.recorded(result, ("gigpo.py", "sft", 4, ""), flags, 2) is None


def test_compare_time_ratio_uses_only_seeds_timed_on_grpos_machine(monkeypatch):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)
    xeon, epyc = {"cpu": "Xeon", "cpus": 2, "platform": "p"}, {"cpu": "EPYC", "cpus": 2, "platform": "p"}

    def run(script, seed, seconds, machine):
        return {"script": script, "start": "sft", "seed": seed, "eval_success": [[0, 0.0], [4, 0.5]], "train_success": [[4, 0.5]],
                "iteration_s": seconds, "prompt_tokens": [[1, 5]], "response_tokens": [[1, 1]], "machine": machine}
    # seed 1: both on the Xeon, 12 s against 10 s; seed 2: grpo.py on the EPYC (20 s), gigpo.py on the Xeon (9 s)
    rows = module.table({"setting": {"num_eval_tasks": 2}, "runs": [
        run("grpo.py", 2, 20.0, epyc), run("grpo.py", 1, 10.0, xeon), run("gigpo.py", 1, 12.0, xeon), run("gigpo.py", 2, 9.0, xeon)]})
    grpo, gigpo = rows
    # by hand: only seed 1 pairs one machine, 12 / 10 = 1.2 (mixing in seed 2 would give (1.2 + 0.45) / 2 = 0.825)
    assert gigpo["time_ratio_to_grpo"] == pytest.approx(1.2) and gigpo["time_ratio_seeds"] == [1]
    assert grpo["seeds"] == [1, 2] and grpo["iteration_s_per_seed"] == [10.0, 20.0] and grpo["time_ratio_seeds"] == [1, 2]
    assert "| 12, 9 (x1.20, seeds 1) |" in module.markdown(rows)
    # seed 3 on the Xeon, but grpo.py shared the cores with other work there (50 s): its pair leaves the ratio and
    # grpo.py's mean, and its seconds are starred
    monkeypatch.setattr(module, "NOT_TIMED_ALONE", {("grpo.py", "sft", 3, ""): "beside another run"})
    grpo, gigpo = module.table({"setting": {"num_eval_tasks": 2}, "runs": [
        run("grpo.py", 2, 20.0, epyc), run("grpo.py", 1, 10.0, xeon), run("grpo.py", 3, 50.0, xeon),
        run("gigpo.py", 1, 12.0, xeon), run("gigpo.py", 2, 9.0, xeon), run("gigpo.py", 3, 11.0, xeon)]})
    assert gigpo["time_ratio_to_grpo"] == pytest.approx(1.2) and gigpo["time_ratio_seeds"] == [1]  # not (1.2 + 0.22) / 2
    assert grpo["iteration_s"] == pytest.approx(15.0) and grpo["not_timed_alone_seeds"] == [3]  # (10 + 20) / 2
    assert "| 10, 20, 50* (x1.00, seeds 1,2) |" in module.markdown([grpo])


def test_compare_end_against_grpo_pools_wins_over_the_seeds_both_ran(monkeypatch):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)

    def run(script, seed, end):
        return {"script": script, "start": "sft", "seed": seed, "eval_success": [[0, 0.0], [4, end]], "train_success": [[4, 0.5]],
                "iteration_s": 1.0, "prompt_tokens": [[1, 5]], "response_tokens": [[1, 1]]}
    # 4 held-out games per seed; grpo.py ends 1/4 and 0/4, proas.py 3/4 and 4/4, plus a seed 3 grpo.py never ran
    rows = module.table({"setting": {"num_eval_tasks": 4}, "runs": [
        run("grpo.py", 1, 0.25), run("grpo.py", 2, 0.0), run("proas.py", 1, 0.75), run("proas.py", 2, 1.0), run("proas.py", 3, 0.0)]})
    grpo, proas = rows
    # by hand: 7 vs 1 wins of 8; with 8 wins in 16 games, the splits (7,1), (1,7) each have C(8,7)C(8,1)/C(16,8) = 64/12870
    # and (8,0), (0,8) 1/12870; every other split is likelier, so p = 130/12870
    assert proas["end_vs_grpo"] == {"seeds": [1, 2], "wins": 7, "grpo_wins": 1, "games": 8, "fisher_p": pytest.approx(130 / 12870)}
    assert "end_vs_grpo" not in grpo and "| 7 vs 1 of 8 (p 0.01) |" in module.markdown(rows)


def test_compare_setting_lists_every_seed_and_method_of_one_setting(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)
    first = {"seeds": [2], "methods": ["grpo.py"], "cold_methods": ["grpo.py"], "learning_rate": 1e-5, "sft_run": "a"}
    later = {"seeds": [1], "methods": ["gigpo.py", "grpo.py"], "cold_methods": ["grpo.py"], "learning_rate": 1e-5, "sft_run": "b"}
    merged = module.merged_setting(first, later)
    assert merged["seeds"] == [1, 2] and merged["methods"] == ["grpo.py", "gigpo.py"] and merged["sft_run"] == "b"
    # another learning rate is another setting: the latest call's lists stand alone
    assert module.merged_setting({**first, "learning_rate": 1e-4}, later) == later
    assert module.merged_setting({}, later) == later
    # a list field added after the first call (variants) is merged too, rather than starting a new setting
    assert module.merged_setting(first, {**later, "variants": ["no-judgment"]})["seeds"] == [1, 2]
    # each diagnostic run on its own seed (pats.py's bank outgrew the cut only on seed 2), in the order asked
    plan = module.plan_runs(module.Args(stage="diagnostics", variants=("no-judgment", "no-adapt"), runs_dir=tmp_path))
    assert [(p[1], p[2], p[3], p[5].name) for p in plan] == [("strata.py", 1, ["--no-judgment"], "strata-no-judgment-seed1"),
                                                              ("pats.py", 2, ["--no-adapt"], "pats-no-adapt-seed2")]
    # which sampler made a run is recorded where its flags say: seeds 3/4 and the LoRA runs use vLLM, older runs HF
    seeds34 = module.plan_runs(module.Args(stage="seeds34", runs_dir=tmp_path))
    lora = module.plan_runs(module.Args(stage="diagnostics", variants=("lora16-1",), runs_dir=tmp_path))
    assert {module.generation_of(p[3]) for p in seeds34 + lora} == {"vllm"}
    assert [module.generation_of(p[3]) for p in plan] == [None, None]
    assert module.generation_of(["--vllm", "True", "--vllm", "False"]) == "hf"
    with pytest.raises(SystemExit, match="no-such: not a diagnostic run"):
        # max_minutes=0: were the check gone, main would stop at the deadline instead of training
        module.main(module.Args(stage="diagnostics", variants=("no-such",), max_minutes=0, runs_dir=tmp_path, out=tmp_path / "c.json"))


def test_prompt_sharing_counts_duplicates_and_shared_prefixes(tiny_model, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("prompt_sharing", REPO / "benchmarks" / "prompt_sharing.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prompt_sharing", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    # by hand: [1,2,3] shares nothing before it, [1,2,4] shares [1,2], the last [1,2,3] repeats the first
    assert module.sharing([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == {
        "samples": 3, "distinct_prompts": 2, "duplicate_samples": 1, "prompt_tokens": 9,
        "shared_prefix_tokens": 5, "shared_prefix_frac": 5 / 9}
    # grpo.py's packing, each shared prefix once: [1 2 3 4] + [5] + [9 9] = 7 of the 10 tokens in one pass
    computed = module.computed_tokens([[1, 2, 3, 4], [1, 2, 3, 5], [9, 9]], [0, 0, 1], minibatch_size=2, budget=100)
    assert computed["one_pass"] == 0.7 and computed["unshared_micro_batches"] == 1.0
    assert 0.7 <= computed["update_random_minibatches"] <= 1.0 and 0.7 <= computed["update_group_minibatches"] <= 1.0
    # through the script: one turn of two episodes of one game, so the second prompt is the first's
    out = tmp_path / "sharing.json"
    bench("prompt_sharing.py", "--model", tiny_model, "--env", "cooking", "--num-tasks", "1", "--group-size", "2",
          "--max-steps", "1", "--max-new-tokens", "4", "--out", str(out))
    r = json.loads(out.read_text())
    assert (r["samples"], r["distinct_prompts"], r["duplicate_samples"]) == (2, 1, 1)
    assert r["shared_prefix_tokens"] * 2 == r["prompt_tokens"]
    assert r["computed_frac"]["one_pass"] < 1.0 == r["computed_frac"]["unshared_micro_batches"]


def test_update_passes_times_both_paths_on_one_rollout(tiny_model, tmp_path):
    """Both update paths on the same samples, each budget and pass. A group of two shares its first prompt: with
    4096-token micro-batches the shared pass computes fewer tokens than the samples hold; with 64 (every sample
    alone) as many."""
    out = tmp_path / "passes.json"
    bench("update_passes.py", "--model", tiny_model, "--preset", "smoke", "--micro-batch-tokens", "64", "4096",
          "--out", str(out))
    r = json.loads(out.read_text())
    assert [(row["micro_batch_tokens"], row["pass"]) for row in r["runs"]] == [(64, "no_grad"), (64, "grad"),
                                                                               (4096, "no_grad"), (4096, "grad")]
    for row in r["runs"]:
        shared, alone = row["shared"]["computed"], row["micro_batch_tokens"] == 64
        assert r["sample_tokens"] <= row["plain"]["computed"]
        assert shared == r["sample_tokens"] if alone else shared < r["sample_tokens"]
        assert row["token_bound"] == row["plain"]["computed"] / shared and (row["token_bound"] > 1) != alone
        assert row["speedup"] == row["plain"]["s"] / row["shared"]["s"] and row["of_bound"] > 0


def test_guidance_probe_shows_the_whole_plan_at_k_equals_K_and_counts_hinted_actions_taken(tiny_model, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("guidance_probe", REPO / "benchmarks" / "guidance_probe.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "guidance_probe", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)

    class Turn:
        def __init__(self, action):
            self.action = action

    class Played:  # hint of 3 actions, 2 turns played: the first matches up to case and spaces, the second does not
        hint = ["open fridge", "take apple from fridge", "prepare meal"]
        turns = [Turn("Open  Fridge"), Turn("look")]

    assert module.followed_hint(Played()) == (1, 2)
    # through the script: one game, unguided then with its whole walkthrough shown
    out = tmp_path / "probe.json"
    import actguide  # on sys.path once guidance_probe is loaded
    import torch
    default_bf16 = actguide.bf16_is_fast(torch.device("cpu"))
    bench("guidance_probe.py", "--model", tiny_model, "--env", "cooking", "--num-tasks", "1", "--episodes", "2",
          "--hint-fractions", "0", "1", "--max-steps", "2", "--max-new-tokens", "4", "--bf16", str(not default_bf16), "--out", str(out))
    r = json.loads(out.read_text())
    assert r["bf16"] is (not default_bf16)  # the precision asked for, not the one actguide.py would pick on this CPU
    plan = r["plans"][0]
    assert len(plan) >= 2 and [row["k_mean"] for row in r["rows"]] == [0.0, float(len(plan))]
    assert [row["episodes"] for row in r["rows"]] == [2, 2] and r["rows"][0]["hint_step_match_rate"] is None
    assert 0.0 <= r["rows"][1]["hint_step_match_rate"] <= 1.0
    assert r["transcripts"][0]["hint"] == plan and 1 <= len(r["transcripts"][0]["actions"]) <= 2


def test_backends_runs_the_compare_setting_with_each_generator(vllm_imports, vllm_model, tmp_path):
    out = tmp_path / "backends.json"
    setting = ["--setting.model", vllm_model, "--setting.env", "cooking", "--setting.sft-num-tasks", "1", "--setting.iterations", "1",
               "--setting.num-tasks", "1", "--setting.group-size", "2", "--setting.max-steps", "2", "--setting.max-new-tokens", "8",
               "--setting.num-eval-tasks", "1", "--setting.eval-every", "1",
               "--setting.extra-flags=--no-gradient-checkpointing --num-env-workers 1 --bf16 False"]
    bench("backends.py", *setting, "--out", str(out), "--runs-dir", str(tmp_path / "runs"), timeout=900)
    r = json.loads(out.read_text())
    vllm, hf = r["runs"]
    assert (vllm["backend"], hf["backend"]) == ("vllm", "hf") and "--vllm True" in vllm["command"] and "--vllm False" in hf["command"]
    for run in (vllm, hf):
        assert run["gen_tokens_per_s"] > 0 and run["eval_s"] > 0 and run["iteration_s"] > 0 and run["peak_rss_mb"] > 0
        assert [i for i, _ in run["eval_success"]] == [0, 1]
    assert vllm["logprob_abs_diff_mean"][0][1] < 0.05  # fp32 engine and fp32 training (--bf16 False)
    assert set(r["vllm_speedup"]) == {"gen_s_per_iteration", "iteration_s", "eval_s", "gen_tokens_per_s"}
    assert r["warm_start"] in vllm["command"]


def test_compare_replication_states_the_test_on_the_new_seeds_and_over_all_seeds(monkeypatch):
    """issue 41's test, stated before the runs: Fisher on the new seeds' pooled games, a one-sided sign-flip test over
    every seed, the pooled difference with its Newcombe interval, and the games whose plan no trained game had."""
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)
    # sign flips of [0.2, 0.1, 0.3, -0.1] (sum 0.5): a sum is 0.7 - 2 x (the magnitudes flipped negative), so >= 0.5
    # only when they total <= 0.1: none, or one of the two 0.1s: 3 of 16
    assert module.sign_flip_p([0.2, 0.1, 0.3, -0.1]) == pytest.approx(3 / 16)
    assert module.sign_flip_p([0.1, 0.2, 0.1, 0.3]) == pytest.approx(1 / 16)  # all four positive: the floor at 4 seeds
    # Wilson of 0/10: [0, z^2 / (10 + z^2)] = [0, 3.841459 / 13.841459] = [0, 0.277533]; of 10/10: [0.722467, 1]
    assert module.wilson_interval(0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    # Newcombe of 10/10 - 0/10: 1 - sqrt((1 - 0.722467)^2 + 0.277533^2) = 1 - 0.392491 = 0.607509, and 1 + 0 = 1
    assert module.newcombe_interval(10, 10, 0, 10) == pytest.approx((0.607509, 1.0), abs=1e-6)
    assert module.newcombe_interval(0, 10, 0, 10) == pytest.approx((-0.277533, 0.277533), abs=1e-6)

    def run(script, seed, end, variant="", won=None):
        entry = {"script": script, "start": "sft", "seed": seed, "eval_success": [[0, 0.0], [4, end]]}
        if seed >= 3:
            entry.update({"num_eval_tasks": 4, "eval_won_by_task": {"4": won}})
        return {**entry, "variant": variant} if variant else entry

    runs = [run("grpo.py", 1, 0.5), run("grpo.py", 2, 0.5), run("proas.py", 1, 1.0), run("proas.py", 2, 0.5),
            run("grpo.py", 3, 0.25, won={"a": 1, "b": 0, "c": 0, "d": 0}), run("grpo.py", 4, 0.0, won={"e": 0, "f": 0, "g": 0, "h": 0}),
            run("proas.py", 3, 0.75, won={"a": 1, "b": 1, "c": 1, "d": 0}), run("proas.py", 4, 0.5, won={"e": 1, "f": 1, "g": 0, "h": 0}),
            run("proas.py", 3, 0.0, "base-gigpo", won=dict.fromkeys("abcd", 0))]
    seen = {3: {"a": True, "b": False, "c": True, "d": False}, 4: {"e": False, "f": True, "g": True, "h": True}}
    rep = module.replication({"setting": {"num_eval_tasks": 2}, "runs": runs}, seen)
    proas = rep["proas.py"]
    # new seeds: 3 + 2 = 5 wins against 1 + 0 = 1 of 8; the splits (5,1) and (1,5) each C(8,5)C(8,1)/C(16,6) = 448/8008,
    # (6,0) and (0,6) 28/8008: p = 952/8008
    assert proas["new_seeds"] == {"seeds": [3, 4], "wins": 5, "grpo_wins": 1, "games": 8, "fisher_p": pytest.approx(952 / 8008)}
    # differences per seed (2 games at seeds 1-2): +0.5, 0, +0.5, +0.5; sums of sign flips >= 1.5: the 2 that flip only the 0
    assert proas["per_seed_difference"] == {"1": 0.5, "2": 0.0, "3": 0.5, "4": 0.5}
    assert proas["sign_flip_p_one_sided"] == pytest.approx(2 / 16)
    # all seeds: wins 2 + 1 + 3 + 2 = 8 against 1 + 1 + 1 + 0 = 3 of 12
    assert {k: proas["all_seeds"][k] for k in ("wins", "grpo_wins", "games")} == {"wins": 8, "grpo_wins": 3, "games": 12}
    assert proas["all_seeds"]["difference"] == pytest.approx(5 / 12)
    assert proas["all_seeds"]["newcombe_95"] == pytest.approx(module.newcombe_interval(8, 12, 3, 12))
    # never-trained plans: b, d (seed 3) and e (seed 4): proas.py won b and e, grpo.py none of them
    assert proas["unseen_plan_games"] == {"games": 3, "wins": 2, "grpo_wins": 0}
    assert rep["proas.py --base-gigpo"]["new_seeds"]["wins"] == 0 and "gigpo.py" not in rep
    assert "| proas.py | 5 vs 1 of 8 (p 0.12) |" in module.replication_markdown(rep)


def test_compare_alfworld_verdict_tests_each_method_from_its_start_per_seed_and_pooled(monkeypatch):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)

    def run(script, seed, start, end, **diagnostics):  # won-by-game at iterations 0 and 4 of three held-out games
        games = lambda won: {f"valid_unseen/g{k}": w for k, w in enumerate(won)}  # noqa: E731
        return {"script": script, "seed": seed, "eval_won_by_task": {"0": games(start), "4": games(end)},
                "iteration_s": 480.0, "diagnostics": diagnostics, "eval_success": [[0, sum(start) / 3], [4, sum(end) / 3]]}
    verdict = module.alfworld_verdict({"runs": [
        run("grpo.py", 1, [0, 0, 1], [1, 1, 1]), run("grpo.py", 2, [0, 0, 0], [0, 0, 0]),
        run("proas.py", 1, [0, 0, 0], [1, 1, 1], **{"proas/masked_frac": [[1, 0.5]]})]})
    grpo, proas = verdict["grpo.py"], verdict["proas.py"]
    # by hand: seed 1, 1 -> 3 of 3 (4 wins in 6 games: splits 1..3 weigh 3, 9, 3 of 15; (1,3) and (3,1): p 6/15)
    assert grpo["per_seed"]["1"] == {"wins": [1, 3], "games": 3, "fisher_p": pytest.approx(0.4)}
    assert grpo["per_seed"]["2"]["fisher_p"] == pytest.approx(1.0)
    # pooled 1 -> 3 of 6: 4 wins in 12 games, splits 0..4 weigh 15, 120, 225, 120, 15 of 495; all but (2,2) count
    assert grpo["pooled"] == {"wins": [1, 3], "games": 6, "fisher_p": pytest.approx(270 / 495)}
    assert proas["pooled"]["fisher_p"] == pytest.approx(0.1) and proas["graph"]["masked_frac"] == {"1": [[1, 0.5]]}
    assert verdict["proas_vs_grpo"] == {"seeds": [1], "wins": 3, "grpo_wins": 3, "games": 3, "fisher_p": pytest.approx(1.0)}
    assert "| grpo.py | seed 1: 1 -> 3 of 3 (p 0.4), seed 2: 0 -> 0 of 3 (p 1) | 1 -> 3 of 6 (p 0.55) | 480, 480 |" \
        in module.alfworld_markdown(verdict)


def test_compare_alfworld2_gate_power_and_task_types_by_hand(monkeypatch):
    spec = importlib.util.spec_from_file_location("compare", REPO / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compare", module)
    spec.loader.exec_module(module)
    game = lambda kind, k: f"valid_unseen/{kind}-Mug-None-Desk-{k}/trial_T2019"  # noqa: E731
    won = {game("pick_and_place_simple", 1): True, game("pick_and_place_simple", 2): False,
           game("pick_heat_then_place_in_recep", 3): False, game("look_at_obj_in_light", 4): True}
    assert module.won_by_type(won) == {"look_at_obj_in_light": [1, 1], "pick_and_place_simple": [1, 2],
                                       "pick_heat_then_place_in_recep": [0, 1]}
    # 2 of 4 held-out games won (50%: the gate's upper bound); 4 tasks a round, kept 4 in 2 rounds then 1 in 8
    metrics = {0: {"eval/won_by_task": won},
               1: {"filter/rounds": 2, "filter/informative_groups": 4, "losses/entropy": 0.2, "charts/success_rate": 0.5},
               2: {"filter/rounds": 8, "filter/informative_groups": 1, "losses/entropy": 0.1, "charts/success_rate": 0.0}}
    gate = module.alfworld2_gate(metrics, num_tasks=4)
    assert (gate["heldout_wins"], gate["mixed_groups"], gate["groups_played"]) == (2, 5, 40)
    assert gate["mixed_share"] == pytest.approx(5 / 40) and not gate["passed"]  # 1/8 of the groups: below a quarter
    metrics[2].update({"filter/rounds": 2, "filter/informative_groups": 4})
    assert module.alfworld2_gate(metrics, num_tasks=4)["passed"]  # 8 of 16, at 50% held-out
    metrics[0]["eval/won_by_task"] = {**won, game("pick_and_place_simple", 2): True}
    assert not module.alfworld2_gate(metrics, num_tasks=4)["passed"]  # 3 of 4 held-out: above 50%
    # Fisher on 4 games each: only 0 -> 4 is below 0.05 (2/70; 0 -> 3 is 8/56), so power is P(0 of 4) x P(4 of 4)
    assert module.fisher_power(0.5, 0.5, 4) == pytest.approx(0.5**4)
    assert module.fisher_power(0.25, 0.5, 4) == pytest.approx(0.75**4 * 0.75**4)  # 0 of 4 at 25%, 4 of 4 at 75%
    assert module.rise_at_power(0.0, 4, power=0.5) == pytest.approx(0.85)  # 0.85^4 = 0.522, 0.84^4 = 0.498


def test_a_deadline_stops_a_run_after_the_checkpoint_whose_successor_would_miss_it(tiny_model, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import torch
    from _common import next_checkpoint_fits, read_metrics, run_training

    # by hand: checkpoints at 100 s and 150 s are 100 s and 50 s apart, so the next is expected by 250 s
    assert next_checkpoint_fits([100.0, 150.0], 250.0) and not next_checkpoint_fits([100.0, 150.0], 249.0)
    assert not next_checkpoint_fits([100.0], 199.0) and next_checkpoint_fits([], 1.0)
    flags = ["--model", tiny_model, "--env", "cooking", "--num-tasks", "1", "--group-size", "2", "--max-steps", "1",
             "--max-new-tokens", "4", "--num-eval-tasks", "1", "--eval-every", "1000", "--save-every", "1",
             "--no-gradient-checkpointing", "--num-env-workers", "1", "--bf16", "False", "--vllm", "False"]
    once = run_training("grpo.py", [*flags, "--total-iterations", "1"], tmp_path / "once", tmp_path / "once.log")
    assert once["returncode"] == 0
    # the first checkpoint lands at about `once`'s wall time, the next ones an iteration apart: a deadline of 2.5x
    # lets at least a second land, and the run stops after the one whose successor would come too late
    deadline = 2.5 * once["wall_s"]
    info = run_training("grpo.py", [*flags, "--total-iterations", "1000"], tmp_path / "long", tmp_path / "long.log",
                        deadline_s=deadline, stop_at_checkpoint=True)
    saved = torch.load(Path(info["run_dir"]) / "checkpoint" / "trainer_state.pt", weights_only=False)["iteration"]
    assert info["killed_at_deadline"] and info["wall_s"] < deadline
    assert saved == max(read_metrics(info["run_dir"])) >= 2  # the last logged iteration is checkpointed: none lost
