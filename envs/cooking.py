"""TextWorld cooking games, generated locally (no download): the offline default env.

TextWorld is ALFWorld's engine. Games come from textworld's own cooking challenge generator and
its bundled Inform7 compiler, deterministically from the task id, and are cached on disk
($COOKING_CACHE, default ~/.cache/agentic-rl/cooking; about 3 s to compile one game).

Task ids are `{split}-{level}-{seed}`. Splits use textworld's disjoint food-item splits
(train / valid / test), so held-out games contain ingredients never seen in training. Levels
are the task types (the skills a recipe needs):

  easy   one room, one ingredient to fetch           (walkthrough of about 5 steps)
  cut    one room, one ingredient to cut with a knife
  cook   one room, one ingredient to cook
  open   six rooms, closed doors and containers
  full   six rooms, two ingredients, open + cut + cook
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from envs import EnvUnavailable, Preset, Step, verl_answer, verl_projection

PRESET = Preset(
    max_steps=30, history_length=2, max_prompt_tokens=2048, max_new_tokens=512,
    success_reward=10.0, invalid_penalty=0.1, eval_split="test",
)

LEVELS = {
    "easy": dict(recipe=1, take=1, go=1, open=False, cook=False, cut=False),
    "cut": dict(recipe=1, take=1, go=1, open=False, cook=False, cut=True),
    "cook": dict(recipe=1, take=1, go=1, open=False, cook=True, cut=False),
    "open": dict(recipe=1, take=1, go=6, open=True, cook=False, cut=False),
    "full": dict(recipe=2, take=2, go=6, open=True, cook=True, cut=True),
}
TASKS_PER_LEVEL = {"train": 2000, "valid": 128, "test": 128}
META_COMMANDS = {"q", "quit", "restart", "restore", "save", "undo", "script", "unscript", "transcript",
                 "noscript", "verbose", "brief", "superbrief", "notify", "version", "pronouns", "score"}
# Predicates that never change during a game (kinds, recipe bookkeeping, the map).
STATIC_PREDICATES = {"base", "cookable", "cuttable", "edible", "inedible", "drinkable", "sharp", "cooking_location",
                     "link", "north_of", "south_of", "east_of", "west_of", "needs_cooking", "out"}


def _textworld():
    try:
        import textworld
        import textworld.challenges.tw_cooking.cooking  # noqa: F401
    except ImportError as e:
        raise EnvUnavailable(f"the cooking env needs textworld: pip install textworld ({e})") from e
    return textworld


def cache_dir(data: str | None = None) -> Path:
    return Path(data or os.environ.get("COOKING_CACHE") or Path.home() / ".cache" / "agentic-rl" / "cooking")


def parse_task_id(task_id: str) -> tuple[str, str, int]:
    split, level, seed = task_id.split("-")
    if split not in TASKS_PER_LEVEL or level not in LEVELS:
        raise ValueError(f"not a cooking task id: {task_id!r}")
    return split, level, int(seed)


# ---- load data ----------------------------------------------------------------------------
def task_ids(split: str, level: str | None = None, **_) -> list[str]:
    if split not in TASKS_PER_LEVEL:
        raise ValueError(f"cooking splits are {list(TASKS_PER_LEVEL)}, not {split!r}")
    levels = [level] if level else list(LEVELS)
    return [f"{split}-{lvl}-{seed}" for seed in range(TASKS_PER_LEVEL[split]) for lvl in levels]


def compile_game(task_id: str, cache: Path) -> Path:
    """Generate and compile the game of `task_id` once; concurrent callers are safe (atomic rename)."""
    path = cache / f"{task_id}.z8"
    if path.exists():
        return path
    textworld = _textworld()
    from textworld.challenges.tw_cooking import cooking

    split, level, seed = parse_task_id(task_id)
    seed += {"train": 0, "valid": 100_000, "test": 200_000}[split]
    tmp = cache / f".tmp-{task_id}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    options = textworld.GameOptions()
    options.seeds = seed
    options.path = str(tmp / "game.z8")
    options.file_ext = ".z8"
    game = cooking.make({**LEVELS[level], "drop": False, "recipe_seed": seed, "split": split}, options)
    textworld.generator.compile_game(game, options)
    os.replace(tmp / "game.json", cache / f"{task_id}.json")
    os.replace(tmp / "game.z8", path)  # last: the .z8 existing means the game is complete
    shutil.rmtree(tmp, ignore_errors=True)
    return path


def game_command(action: str) -> str:
    """Model text as the Z-machine may receive it: printable ASCII without '\\' (control bytes kill
    the interpreter, '\\' starts its own escapes), at most 190 bytes, and no interpreter
    meta-command (quit, restart, undo...: not game actions) - those arrive as an empty command."""
    command = re.sub(r"[^\x20-\x5b\x5d-\x7e]+", " ", action).strip()[:190]
    return "" if command.split(" ")[0] in META_COMMANDS else command


def clean(feedback: str, objective: str = "") -> str:
    """Drop the title banner, the '>' prompt and the status line TextWorld appends."""
    if objective and objective in feedback:
        feedback = feedback[feedback.index(objective):]
    feedback = re.split(r">[ \t]{2,}|\n>\s*$", feedback, maxsplit=1)[0]
    return re.sub(r"\n{3,}", "\n\n", feedback).strip()


# ---- state ------------------------------------------------------------------------------
def fact_text(fact) -> str:
    return f"{fact.name}({', '.join(a.name for a in fact.arguments)})"


def facts_state(facts) -> frozenset:
    """The game's changing logical facts (where things are, open/closed, cut/cooked...)."""
    return frozenset(fact_text(f) for f in facts if f.name not in STATIC_PREDICATES and not f.name.startswith("ingredient_"))


def project_state(state: frozenset, task: str, reference_actions: list[str]) -> frozenset:
    """ProAS's abstract state: the facts whose subject the goal or the expert plan mentions (where
    it is, held, open, cut, cooked); the agent's room when mentioned, else 'elsewhere'. Moving an
    unrelated object, even into or out of a relevant container, leaves it unchanged."""
    text = " ".join([task.lower(), *[a.lower() for a in reference_actions]])
    mentioned = lambda name: re.search(rf"\b{re.escape(name.lower())}\b", text) is not None  # noqa: E731
    kept = set()
    for fact in state:
        name, _, rest = fact.partition("(")
        args = [a.strip() for a in rest.rstrip(")").split(",") if a.strip()]
        if name == "at" and args and args[0] == "P":
            kept.add(fact if mentioned(args[1]) else "at(P, elsewhere)")
        elif args and args[0] not in ("P", "I") and mentioned(args[0]):  # facts about a mentioned thing
            kept.add(fact)
    return frozenset(kept)



class Env:
    def __init__(self, level: str | None = None, data: str | None = None, **_):
        self.cache = cache_dir(data)
        self.cache.mkdir(parents=True, exist_ok=True)
        self._env = None
        self.task = ""
        self.task_type = ""

    def prepare(self, task_id: str) -> None:
        compile_game(task_id, self.cache)

    # ---- reset ----------------------------------------------------------------------------
    def reset(self, task_id: str) -> Step:
        textworld = _textworld()
        infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True, facts=True, objective=True,
                                   score=True, max_score=True, extras=["walkthrough"])
        self.close()
        self._env = textworld.start(str(compile_game(task_id, self.cache)), request_infos=infos)
        gs = self._env.reset()
        self.task = gs.objective.strip()
        self.task_type = parse_task_id(task_id)[1]
        return self._step(gs, clean(gs.feedback, self.task))

    # ---- step -----------------------------------------------------------------------------
    def step(self, action: str) -> Step:
        gs, _, done = self._env.step(game_command(action))
        return self._step(gs, clean(gs.feedback))

    def _step(self, gs, observation: str) -> Step:
        return Step(
            observation=observation,
            reward=float(bool(gs.won)),
            done=bool(gs.done or gs.won or gs.lost),
            won=bool(gs.won),
            admissible=[a for a in gs.admissible_commands if a != "help"],
            task=self.task,
            task_type=self.task_type,
            state=facts_state(gs.facts),
            score=gs.score / max(gs.max_score, 1),
        )

    # ---- reference actions ----------------------------------------------------------------
    def reference_actions(self, task_id: str) -> list[str]:
        """The game's walkthrough (TextWorld's expert plan; it wins the game)."""
        import json

        path = compile_game(task_id, self.cache).with_suffix(".json")
        return list(json.loads(path.read_text())["metadata"]["walkthrough"])

    def demonstration(self, task_id: str) -> list[str]:
        """The expert's whole episode: the reference actions win the game on their own."""
        return self.reference_actions(task_id)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


# ---- prompt ---------------------------------------------------------------------------------
# verl-agent's ALFWorld templates (shared/reference/verl_agent.md) with the game named.
TEMPLATE_NO_HIS = """
You are an expert agent playing a TextWorld cooking game. Your task is to: {task}
Your current observation is: {current_observation}
Your admissible actions of the current situation are: [{admissible_actions}].

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""

TEMPLATE = """
You are an expert agent playing a TextWorld cooking game. Your task is to: {task}
Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} observations and the corresponding actions you took: {action_history}
You are now at step {current_step} and your current observation is: {current_observation}
Your admissible actions of the current situation are: [{admissible_actions}].

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""


# The `oneline` answer instruction (env `cooking-small`): a model of ~100M parameters does not
# follow verl-agent's two-sentence instruction (SmolLM2-135M: 0 of 32 answers well formed, even
# with `<think>` prefilled) but copies a one-line example (8 of 32 with `--response-prefix
# "<think>"`, 0 of 32 without). The example's action, `look`, is admissible in every game and
# never advances it, so the example teaches the format and not the solution.
ONELINE_ANSWER = """Now it's your turn to take an action.
Answer on one line: a short thought in <think> </think> tags, then one admissible action in <action> </action> tags. Example:
<think>I should look around first.</think><action>look</action>
"""


def prompt(task, observation, admissible, history, step_count, history_length, template: str = "verl") -> str:
    actions = "\n ".join(f"'{a}'" for a in (admissible or []))
    if step_count == 0 or history_length <= 0 or not history:
        text = TEMPLATE_NO_HIS.format(task=task, current_observation=observation, admissible_actions=actions)
    else:
        first = step_count - len(history) + 1
        action_history = "\n".join(
            f"[Observation {first + k}: '{o}', Action {first + k}: '{a}']" for k, (o, a) in enumerate(history)
        )
        text = TEMPLATE.format(task=task, step_count=step_count, history_length=len(history), action_history=action_history,
                               current_step=step_count + 1, current_observation=observation, admissible_actions=actions)
    if template == "oneline":
        return text[: text.index("Now it's your turn")] + ONELINE_ANSWER
    if template != "verl":
        raise ValueError(f"unknown cooking prompt template {template!r} (verl, oneline)")
    return text


# ---- parse ----------------------------------------------------------------------------------
def parse(response: str) -> tuple[str, bool]:
    """verl-agent's ALFWorld projection: the text in <action></action>, else the last 30 chars."""
    return verl_projection(response, tail_chars=30)


def answer(thought: str, action: str) -> str:
    """The answer format parse() reads: <think>thought</think> then <action>action</action>."""
    return verl_answer(thought, action)
