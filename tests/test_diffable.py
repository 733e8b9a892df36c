"""The layout every script shares, and the shared code kept shared.

Each script is a short docstring, imports, Args, the method, then one `# ENGINEERING` banner; below the banner the
text is grpo.py's, byte for byte, so a feature of the machinery lands in every script at once and never in the
middle of a method. Above the banner, a function that exists under the same name in grpo.py is grpo.py's text
unless the method's copy is marked `# ALGO LOGIC`."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
METHODS = ["gigpo.py", "proas.py", "strata.py", "actguide.py", "pats.py", "sft.py"]
SCRIPTS = ["grpo.py", *METHODS]
BANNER = "\n# ENGINEERING"


def top_level_sources(text: str) -> dict[str, str]:
    return {node.name: ast.get_source_segment(text, node) or "" for node in ast.parse(text).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def split(script: str) -> tuple[str, str]:
    """(method part, engineering part) of a script, at its banner's first line."""
    text = (REPO / script).read_text()
    assert text.count(BANNER) == 1, f"{script}: one line beginning '# ENGINEERING' expected"
    at = text.rindex("\n# ===", 0, text.index(BANNER)) + 1
    return text[:at], text[at:]


@pytest.mark.parametrize("method", METHODS)
def test_everything_below_the_banner_is_grpos_text(method):
    assert split(method)[1] == split("grpo.py")[1], f"{method}: the text below the ENGINEERING banner differs from grpo.py's"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_method_part_defines_nothing_the_engineering_defines(script):
    method, engineering = split(script)
    shared = set(top_level_sources(engineering))
    assert not set(top_level_sources(method)) & shared


@pytest.mark.parametrize("method", METHODS)
def test_shared_functions_are_identical_to_grpo(method):
    base = top_level_sources(split("grpo.py")[0])
    drifted = [name for name, src in top_level_sources(split(method)[0]).items()
               if name in base and src != base[name] and "ALGO LOGIC" not in src]
    assert not drifted, f"{method}: {drifted} differ from grpo.py without an '# ALGO LOGIC' marker"


@pytest.mark.parametrize("script", SCRIPTS)
def test_layout_docstring_args_method_main_banner(script):
    """A docstring of at most 30 lines, Args first of the definitions, main() the last one above the banner, the
    entry point last; no line over 120 characters."""
    text = (REPO / script).read_text()
    tree = ast.parse(text)
    docstring = ast.get_docstring(tree, clean=False)
    assert docstring is not None and len(docstring.strip().splitlines()) <= 30
    method = [n.name for n in ast.parse(split(script)[0]).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert method[0] == "Args" and method[-1] == "main"
    assert text.rstrip().endswith('if __name__ == "__main__":\n    main()')
    long = [k + 1 for k, line in enumerate(text.splitlines()) if len(line) > 120]
    assert not long, f"{script}: lines over 120 characters: {long}"


def test_proas_takes_gigpos_anchor_code_unchanged():
    """proas.py --base gigpo: every function it shares with gigpo.py (and not with grpo.py) is gigpo.py's text."""
    base, gigpo, proas = (top_level_sources((REPO / f).read_text()) for f in ("grpo.py", "gigpo.py", "proas.py"))
    shared = [name for name in gigpo if name in proas and name not in base]
    assert {"flatten_steps", "discounted_returns", "anchor_groups", "episode_advantages", "step_advantages"} <= set(shared)
    assert [name for name in shared if gigpo[name] != proas[name]] == []


def test_grpo_has_the_functions_methods_build_on():
    names = set(top_level_sources((REPO / "grpo.py").read_text()))
    for name in ["Args", "rollout", "play_groups", "step_scores", "grpo_advantages", "training_batch", "update_policy",
                 "ppo_clip_loss", "evaluate", "main", "Run", "save_checkpoint"]:
        assert name in names


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_probes_its_env_before_the_model_and_stops_when_most_episodes_crash(script):
    """grpo.py's and sft.py's behaviour is tested end to end (tests/test_env_search.py, tests/test_sft.py); every
    script lists its tasks (which starts one env) before Run loads the model, and stops on a rollout (sft.py: on its
    demonstration replay) where most episodes crashed."""
    method = split(script)[0]
    main = top_level_sources(method)["main"]
    assert main.index("list_tasks(spec, args)") < main.index("Run(args)")
    assert "print(spec.probe(train_tasks))" in split(script)[1]
    assert "envs.most_crashed(" in method


def imports(script: str) -> set[str]:
    """Every name a script's top-level imports bind, with its module (`torch.distributed as dist`, `typing.Optional`)."""
    names = set()
    for node in ast.parse((REPO / script).read_text()).body:
        if isinstance(node, ast.Import):
            names |= {f"{a.name} as {a.asname or a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {f"{node.module}.{a.name} as {a.asname or a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("method", METHODS)
def test_every_script_imports_what_grpos_engineering_needs(method):
    """The shared code below the banner uses what grpo.py imports: every script imports it too (a method may import
    more, and need not import what only grpo.py's method part uses, `typing.Literal`). sft.py once lacked
    `functools`, and only a GGUF model reached the line that used it."""
    missing = imports("grpo.py") - imports(method) - {"typing.Literal as Literal"}
    assert not missing, sorted(missing)
