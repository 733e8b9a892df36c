"""Shared code stays shared: a function that exists under the same name in grpo.py and a method
file is textually identical there, unless the method's copy is marked `# ALGO LOGIC`."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
METHODS = ["gigpo.py", "proas.py", "strata.py", "actguide.py", "pats.py", "sft.py"]


def top_level_sources(path: Path) -> dict[str, str]:
    text = path.read_text()
    return {
        node.name: ast.get_source_segment(text, node) or ""
        for node in ast.parse(text).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


@pytest.mark.parametrize("method", [m for m in METHODS if (REPO / m).exists()] or [pytest.param("none", marks=pytest.mark.skip("no method file yet"))])
def test_shared_functions_are_identical_to_grpo(method):
    base = top_level_sources(REPO / "grpo.py")
    drifted = [name for name, src in top_level_sources(REPO / method).items()
               if name in base and src != base[name] and "ALGO LOGIC" not in src]
    assert not drifted, f"{method}: {drifted} differ from grpo.py without an '# ALGO LOGIC' marker"


def test_proas_takes_gigpos_anchor_code_unchanged():
    """proas.py --base gigpo: every function it shares with gigpo.py (and not with grpo.py) is gigpo.py's text."""
    base, gigpo, proas = (top_level_sources(REPO / f) for f in ("grpo.py", "gigpo.py", "proas.py"))
    shared = [name for name in gigpo if name in proas and name not in base]
    assert {"flatten_steps", "discounted_returns", "anchor_groups", "episode_advantages", "step_advantages"} <= set(shared)
    assert [name for name in shared if gigpo[name] != proas[name]] == []


def test_grpo_has_the_functions_methods_build_on():
    names = set(top_level_sources(REPO / "grpo.py"))
    for name in ["Args", "rollout", "step_scores", "grpo_advantages", "update_policy", "ppo_clip_loss", "evaluate", "save_checkpoint"]:
        assert name in names


ENV_GUARDS = ["        print(spec.probe(train_tasks))  # one env started now: a broken env stops the run before the model loads",
              "                if crashed := envs.most_crashed([e.crashed for e in new]):",
              "                    fail(crashed)"]


@pytest.mark.parametrize("script", ["grpo.py", *METHODS])
def test_every_script_probes_its_env_and_stops_when_most_episodes_crash(script):
    """grpo.py's and sft.py's behaviour is tested end to end (tests/test_env_search.py, tests/test_sft.py);
    every RL script runs grpo.py's lines; sft.py, which has no rollout, stops on its demonstration replay."""
    main = (REPO / script).read_text().split('if __name__ == "__main__":')[1].splitlines()
    if script == "sft.py":
        assert ENV_GUARDS[0] in main and any("envs.most_crashed(" in line for line in main)
    else:
        assert all(line in main for line in ENV_GUARDS)
    assert main.index(ENV_GUARDS[0]) < min(i for i, line in enumerate(main) if "load_policy(" in line)
