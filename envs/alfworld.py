"""ALFWorld (TextWorld PDDL household games): the papers' main env (PATS, StraTA, ProAS).

Games are ALFWorld's `game.tw-pddl` files under `$ALFWORLD_DATA/json_2.1.1/` (`alfworld-download`
fetches them on a user's machine, default ~/.cache/alfworld). Each game is registered directly
with TextWorld and ALFWorld's own wrappers (AlfredDemangler names the objects, AlfredInfos adds
the game file), as verl-agent's AlfredTWEnv does, but without its `traj_data.json` scan, so the
six task types come from the trial folder name instead.

Task ids are `{split_dir}/{task folder}/{trial}`. Splits follow verl-agent's config: train,
eval_in_distribution (valid_seen, 140 games) and eval_out_of_distribution (valid_unseen, 134).
Like verl-agent's `collect_game_files`, games marked unsolvable or with "movable" / "Sliced" in
their path are left out. Reward 10 * won, 50 steps, verl-agent's prompt (history 2) and projection.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

from envs import EnvUnavailable, Preset, Step, verl_answer, verl_projection

# verl-agent's defaults (examples/*_trainer/run_alfworld.sh); its validation set is in-distribution.
PRESET = Preset(
    max_steps=50, history_length=2, max_prompt_tokens=2048, max_new_tokens=512,
    success_reward=10.0, invalid_penalty=0.1, eval_split="eval_in_distribution",
)

SPLITS = {"train": "train", "eval_in_distribution": "valid_seen", "eval_out_of_distribution": "valid_unseen"}
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")
INSTALL = "pip install alfworld textworld fast-downward-textworld"
# PDDL predicates that change while playing (alfred.pddl); the rest (types, abilities, the map) are fixed.
# `checked`, `examined` and `wasinreceptacle` record history rather than the world, and the
# planner's `not_*` facts are negations, so neither is part of the state.
CHANGING = {"atlocation", "inreceptacle", "inreceptacleobject", "isreceptacleobjectfull", "opened", "holds",
            "holdsany", "holdsanyreceptacleobject", "full", "isclean", "ishot", "iscool", "ison", "istoggled",
            "issliced", "objectatlocation"}
AGENT = "agent1"


def _textworld():
    try:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    except ImportError as e:
        raise EnvUnavailable(f"the alfworld env needs alfworld and textworld: {INSTALL} ({e})") from e
    return textworld, AlfredDemangler, AlfredInfos


def data_root(data: str | None = None) -> Path:
    """The folder holding json_2.1.1/ (--env-data, else $ALFWORLD_DATA, else alfworld's default)."""
    root = Path(data or os.environ.get("ALFWORLD_DATA") or Path.home() / ".cache" / "alfworld").expanduser()
    return root.parent if root.name == "json_2.1.1" else root


def task_type_of(task_id: str) -> str:
    folder = task_id.split("/")[-2]
    return next(t for t in TASK_TYPES if folder.startswith(t))


# ---- load data ----------------------------------------------------------------------------
def task_ids(split: str, data: str | None = None, **_) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"alfworld splits are {list(SPLITS)}, not {split!r}")
    return list(_games(str(data_root(data)), SPLITS[split]))


@lru_cache(maxsize=None)
def _games(root: str, split_dir: str) -> tuple[str, ...]:
    folder = Path(root) / "json_2.1.1" / split_dir
    if not folder.is_dir():
        raise EnvUnavailable(f"ALFWorld games not found at {folder}: run `alfworld-download` "
                             f"(or set ALFWORLD_DATA / --env-data to the folder holding json_2.1.1)")
    ids = []
    for game in sorted(folder.glob("*/*/game.tw-pddl")):
        rel = game.parent.relative_to(folder.parent).as_posix()
        if "movable" in rel or "Sliced" in rel or not rel.split("/")[1].startswith(TASK_TYPES):
            continue
        if '"solvable": false' in game.read_text():
            continue
        ids.append(rel)
    return tuple(ids)


# ---- state ------------------------------------------------------------------------------
def facts_state(facts, locations: dict[str, str]) -> frozenset:
    """The changing PDDL facts, locations named by their receptacles ('loc 12' -> 'diningtable 2')."""
    out = set()
    for fact in facts:
        if fact.name not in CHANGING:
            continue
        args = [locations.get(a.name.strip(), a.name.strip()) for a in fact.arguments]
        out.add(f"{fact.name}({', '.join(args)})")
    return frozenset(out)


def project_state(state: frozenset, task: str, reference_actions: list[str]) -> frozenset:
    """ProAS's abstract state: facts whose subject (first non-agent argument) the goal or the
    walkthrough names ('apple 1'), other unnamed arguments read 'elsewhere'; the agent's place is
    kept when named, else 'elsewhere'. Moving an unrelated mug cannot change it."""
    text = " ".join([task.lower(), *[a.lower() for a in reference_actions]])

    def named(entity: str) -> bool:  # shared locations read 'drawer 6|drawer 7'
        return any(re.search(rf"\b{re.escape(part)}\b", text) for part in entity.split("|"))

    kept = set()
    for fact in state:
        name, _, rest = fact.partition("(")
        args = [a.strip() for a in rest.rstrip(")").split(",") if a.strip()]
        objects = [a for a in args if a != AGENT]
        if name == "atlocation":
            kept.add(f"atlocation({AGENT}, {objects[0] if named(objects[0]) else 'elsewhere'})")
        elif objects and named(objects[0]):
            shown = [a if a == AGENT or a == objects[0] or named(a) else "elsewhere" for a in args]
            kept.add(f"{name}({', '.join(shown)})")
    return frozenset(kept)


class Env:
    def __init__(self, data: str | None = None, **_):
        self.root = data_root(data)
        self._env = None
        self._game: str | None = None
        self._locations: dict[str, str] = {}
        self.task = ""
        self.task_type = ""

    def game_file(self, task_id: str) -> Path:
        path = self.root / "json_2.1.1" / task_id / "game.tw-pddl"
        if not path.exists():
            raise EnvUnavailable(f"no ALFWorld game {path}: run `alfworld-download` or set ALFWORLD_DATA")
        return path

    def prepare(self, task_id: str) -> None:
        self.game_file(task_id)

    # ---- reset ----------------------------------------------------------------------------
    def reset(self, task_id: str) -> Step:
        textworld, AlfredDemangler, AlfredInfos = _textworld()
        path = str(self.game_file(task_id))
        if self._env is None:
            infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=True, extras=["gamefile"])
            self._env = textworld.start(path, request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])
        elif path != self._game:
            self._env.load(path)  # reusing the wrapped env skips re-creating it; the game is re-grounded
        self._game = path
        gs = self._env.reset()
        self._locations = _location_names(gs.facts)
        observation = gs.feedback.strip()
        start = observation.find("Your task is to: ")  # verl-agent's task extraction
        self.task = observation[start + len("Your task is to: "):].strip() if start != -1 else ""
        self.task_type = task_type_of(task_id)
        return self._step(gs, observation)

    # ---- step -----------------------------------------------------------------------------
    def step(self, action: str) -> Step:
        gs, _, _ = self._env.step(action)
        return self._step(gs, gs.feedback.strip())

    def _step(self, gs, observation: str) -> Step:
        won = bool(gs.won)
        return Step(
            observation=observation,
            reward=PRESET.success_reward * won,
            done=bool(gs.done or won),
            won=won,
            admissible=[a for a in gs.admissible_commands if a != "help"],
            task=self.task,
            task_type=self.task_type,
            state=facts_state(gs.facts, self._locations),
            score=float(won),
        )

    # ---- reference actions ----------------------------------------------------------------
    def reference_actions(self, task_id: str) -> list[str]:
        """The game's walkthrough (ALFWorld's expert plan, stored in the game file; it wins)."""
        return list(json.loads(self.game_file(task_id).read_text())["walkthrough"])

    def demonstration(self, task_id: str) -> list[str]:
        """The expert's whole episode: the reference actions win the game on their own."""
        return self.reference_actions(task_id)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env, self._game = None, None


def _location_names(facts) -> dict[str, str]:
    """PDDL location id -> the receptacles there (some share one: 'stoveburner 1|stoveburner 2')."""
    at: dict[str, list[str]] = {}
    for fact in facts:
        if fact.name == "receptacleatlocation":
            receptacle, location = (a.name.strip() for a in fact.arguments)
            at.setdefault(location, []).append(receptacle)
    return {loc: "|".join(sorted(names)) for loc, names in at.items()}


# ---- prompt ---------------------------------------------------------------------------------
# verl-agent's agent_system/environments/prompts/alfworld.py, verbatim.
TEMPLATE_NO_HIS = """
You are an expert agent operating in the ALFRED Embodied Environment.
Your current observation is: {current_observation}
Your admissible actions of the current situation are: [{admissible_actions}].

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""

TEMPLATE = """
You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task_description}
Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} observations and the corresponding actions you took: {action_history}
You are now at step {current_step} and your current observation is: {current_observation}
Your admissible actions of the current situation are: [{admissible_actions}].

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""


def prompt(task, observation, admissible, history, step_count, history_length) -> str:
    actions = "\n ".join(f"'{a}'" for a in (admissible or []) if a != "help")
    if step_count == 0 or history_length <= 0 or not history:
        return TEMPLATE_NO_HIS.format(current_observation=observation, admissible_actions=actions)
    first = step_count - len(history) + 1
    action_history = "\n".join(
        f"[Observation {first + k}: '{o}', Action {first + k}: '{a}']" for k, (o, a) in enumerate(history)
    )
    return TEMPLATE.format(task_description=task, step_count=step_count, history_length=len(history),
                           action_history=action_history, current_step=step_count + 1,
                           current_observation=observation, admissible_actions=actions)


# ---- parse ----------------------------------------------------------------------------------
def parse(response: str) -> tuple[str, bool]:
    """verl-agent's ALFWorld projection: the text in <action></action>, else the last 30 chars."""
    return verl_projection(response, tail_chars=30)


def answer(thought: str, action: str) -> str:
    """The answer format parse() reads: <think>thought</think> then <action>action</action>."""
    return verl_answer(thought, action)
