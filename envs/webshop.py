"""WebShop (Princeton's simulated e-commerce site, text mode), as verl-agent runs it.

The engine, `web_agent_site`, is not on PyPI: `bash scripts/install_webshop.sh` clones it with
the small setting (1,000 products, synthetic goals) into $WEBSHOP_ROOT (default
~/.cache/agentic-rl/webshop; it needs Python <= 3.10 and Java 11+ for its pyserini index).
The adapter drives `WebAgentTextEnv(observation_mode="text", human_goals=False)` exactly as
verl-agent's WebshopWorker does, and reuses one simulated server (products, index, goals) for
every env instance of a worker process.

Task ids are goal indices: test = goals 0..499 (verl-agent's evaluation goals), train = 500...
Unlike verl-agent, whose workers shuffle the goals with their own seeds (so index k names
different goals in different groups), every instance here uses seed 42, so an index is one goal.

Actions are `search[query]` and `click[button]`; anything else does nothing. The episode ends on
"Buy Now" with the engine's score r in [0, 1] (Step.score); reward 10 and won when r == 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from envs import EnvUnavailable, Preset, Step, verl_answer, verl_projection

# verl-agent's examples/*_trainer/run_webshop.sh: 15 steps, history 2, 4096-token prompts, minibatches of 64 step
# samples (ppo_mini_batch_size), GiGPO's mean_norm.
PRESET = Preset(
    max_steps=15, history_length=2, max_prompt_tokens=4096, max_new_tokens=512,
    success_reward=10.0, invalid_penalty=0.1, eval_split="test", minibatch_size=64, step_norm="mean",
)

SEED = 42  # WebAgentTextEnv's default; fixes the goal order for every worker
EVAL_GOALS = 500
INSTALL = "bash scripts/install_webshop.sh (then set WEBSHOP_ROOT or --env-data to the WebShop folder)"
_SERVERS: dict[str, object] = {}  # WebShop root -> its SimServer, shared within a process


def webshop_root(data: str | None = None) -> Path:
    return Path(data or os.environ.get("WEBSHOP_ROOT") or Path.home() / ".cache" / "agentic-rl" / "webshop").expanduser()


def text_env_class(root: Path):
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # web_agent_site lives in the WebShop checkout, not site-packages
    try:
        from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
    except ImportError as e:
        raise EnvUnavailable(f"the webshop env needs Princeton WebShop's web_agent_site: {INSTALL} ({e})") from e
    return WebAgentTextEnv


def make_engine(root: Path):
    """A WebAgentTextEnv on the shared server of this process (built on first use, slow)."""
    engine = text_env_class(root)(observation_mode="text", num_products=None, human_goals=False, seed=SEED,
                                  server=_SERVERS.get(str(root)))
    _SERVERS[str(root)] = engine.server
    return engine


# ---- load data ----------------------------------------------------------------------------
def task_ids(split: str, data: str | None = None, **_) -> list[str]:
    text_env_class(webshop_root(data))  # a missing engine fails here, in the main process, with its install line
    if split == "test":
        return [str(i) for i in range(EVAL_GOALS)]
    if split == "train":  # the goal count needs the engine's goal list
        return [str(i) for i in range(EVAL_GOALS, len(make_engine(webshop_root(data)).server.goals))]
    raise ValueError(f"webshop splits are ['train', 'test'], not {split!r}")


def task_type(task_id: str) -> str:
    return "webshop"  # synthetic goals have no types


# ---- observation formatting (verl-agent's WebshopEnvironmentManager) -------------------------
def task_of(raw_observation: str) -> str:
    """'WebShop [SEP] Instruction: [SEP] <goal> [SEP] Search' -> '<goal>'"""
    parts = raw_observation.split(" [SEP] ")
    if len(parts) < 3 or parts[1] != "Instruction:":
        raise ValueError(f"not a WebShop start page: {raw_observation[:200]!r}")
    return parts[2]


def format_obs(raw_observation: str, task: str) -> str:
    """The page text after the instruction, each part quoted: "'Back to Search' [SEP] 'Next >' ..."."""
    parts = raw_observation.split(" [SEP] ")
    if task not in parts:
        return raw_observation
    return " [SEP] ".join(f"'{p}'" for p in parts[parts.index(task) + 1:])


def format_actions(available: dict) -> list[str]:
    """{'has_search_bar', 'clickables'} -> ['search[<your query>]', 'click[back to search]', ...]"""
    return (["search[<your query>]"] if available["has_search_bar"] else []) + [f"click[{c}]" for c in available["clickables"]]


# ---- state ------------------------------------------------------------------------------
def webshop_state(page: str, asin: str | None, options: dict) -> frozenset:
    """(page kind, chosen product, selected options), as one frozenset of strings."""
    return frozenset([f"page:{page or 'search'}", f"product:{(asin or '').lower()}",
                      *(f"option:{name}={value}" for name, value in options.items())])


PRODUCT_PAGES = ("item_page", "item_sub_page", "done")  # the pages that show one product


def project_state(state: frozenset, task: str, reference_actions: list[str]) -> frozenset:
    """The page kind always. On a page that shows a product, also the product and the options the
    reference clicks (another product: 'product:other', so browsing unrelated products stays one
    state). A search or results page is its page kind alone, whatever was searched or seen before."""
    clicked = {a[len("click["):-1].lower() for a in reference_actions if a.startswith("click[")}
    page = next((fact for fact in state if fact.startswith("page:")), "page:search")
    if page[len("page:"):] not in PRODUCT_PAGES:
        return frozenset([page])
    kept = {page}
    for fact in state:
        kind, _, value = fact.partition(":")
        if kind == "product":
            kept.add(fact if not value or value in clicked else "product:other")
        elif kind == "option" and value.partition("=")[2].lower() in clicked:
            kept.add(fact)
    return frozenset(kept)


def project_action(action: str) -> str:
    """Every search is one progress-graph action: the words vary, the results page is one state class."""
    return "search[...]" if action.lower().startswith("search[") else action


def reference_variants(transitions: list[tuple]) -> list[tuple]:
    """Every order of the reference's option clicks (the ProAS paper's Table 10: colour first or size
    first both advance). From the state s before the first click, with the clicked option facts o_v:
    (s + U, click[v], s + U + {o_v}) for every subset U of the options and every option v outside U."""
    clicks = [(s, a, next(iter(s_next - s))) for s, a, s_next in transitions
              if len(s_next - s) == 1 and not s - s_next and next(iter(s_next - s)).startswith("option:")]
    if len(clicks) < 2:
        return []
    base, variants = clicks[0][0], []
    for chosen in range(2 ** len(clicks)):
        here = base | {fact for k, (_, _, fact) in enumerate(clicks) if chosen >> k & 1}
        variants += [(here, a, here | {fact}) for k, (_, a, fact) in enumerate(clicks) if not chosen >> k & 1]
    return variants


class Env:
    def __init__(self, data: str | None = None, **_):
        self.root = webshop_root(data)
        self._engine = None
        self.session = ""
        self.task = ""
        self.task_type = "webshop"

    def engine(self):
        if self._engine is None:
            self._engine = make_engine(self.root)
        return self._engine

    def prepare(self, task_id: str) -> None:
        self.engine()

    # ---- reset ----------------------------------------------------------------------------
    def reset(self, task_id: str) -> Step:
        engine = self.engine()
        raw, _ = engine.reset(session=int(task_id))
        self.session = engine.session
        self.task = task_of(raw)
        return self._step(raw, score=0.0, done=False)

    # ---- step -----------------------------------------------------------------------------
    def step(self, action: str) -> Step:
        raw, score, done, _ = self._engine.step(action)
        return self._step(raw, score=float(score), done=bool(done))

    def _step(self, raw: str, score: float, done: bool) -> Step:
        engine = self._engine
        # On "Buy Now" the engine starts a new random session itself; our session keeps its record.
        record = engine.server.user_sessions[self.session]
        page = "done" if done else engine.server.get_page_name(engine.browser.current_url)
        won = done and score == 1.0
        return Step(
            observation=format_obs(raw, self.task),
            reward=PRESET.success_reward * won,
            done=done,
            won=won,
            admissible=[] if done else format_actions(engine.get_available_actions()),
            task=self.task,
            task_type=self.task_type,
            state=webshop_state(page, record.get("asin"), record.get("options") or {}),
            score=score,
        )

    # ---- reference actions ----------------------------------------------------------------
    def reference_actions(self, task_id: str) -> list[str]:
        """From the goal's attributes: search its product title, open it, click each goal option,
        buy. (Written to the engine's goal records; the title search is expected, not checked here,
        to list the product on the first results page.)"""
        goal = self.engine().server.goals[int(task_id)]
        options = goal["goal_options"]
        values = list(options.values()) if isinstance(options, dict) else list(options)
        return [f"search[{goal['name'].lower()}]", f"click[{goal['asin'].lower()}]",
                *(f"click[{v}]" for v in values), "click[buy now]"]

    def demonstration(self, task_id: str) -> list[str]:
        """The expert's whole episode: the reference actions win the game on their own."""
        return self.reference_actions(task_id)

    def close(self) -> None:
        self._engine = None  # the server stays shared for the process's other instances


# ---- prompt ---------------------------------------------------------------------------------
# verl-agent's agent_system/environments/prompts/webshop.py, verbatim (the hyphen in
# "e‑commerce" is U+2011, and the first line of the first template ends in a space).
TEMPLATE_NO_HIS = """
You are an expert autonomous agent operating in the WebShop e\u2011commerce environment. 
Your task is to: {task_description}.
Your current observation is: {current_observation}.
Your admissible actions of the current situation are: 
[
{available_actions}
].

Now it's your turn to take one action for the current step.
You should first reason step-by-step about the current situation, then think carefully which admissible action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""

TEMPLATE = """
You are an expert autonomous agent operating in the WebShop e\u2011commerce environment.
Your task is to: {task_description}.
Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} observations and the corresponding actions you took: {action_history}
You are now at step {current_step} and your current observation is: {current_observation}.
Your admissible actions of the current situation are: 
[
{available_actions}
].

Now it's your turn to take one action for the current step.
You should first reason step-by-step about the current situation, then think carefully which admissible action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""
MAX_PROMPT_CHARS = 13_000  # verl-agent falls back to the no-history template beyond this


def prompt(task, observation, admissible, history, step_count, history_length) -> str:
    actions = "\n".join(f"'{a}'," for a in (admissible or []))
    no_history = TEMPLATE_NO_HIS.format(task_description=task, current_observation=observation, available_actions=actions)
    if step_count == 0 or history_length <= 0 or not history:
        return no_history
    first = step_count - len(history) + 1
    action_history = "\n".join(
        f"[Observation {first + k}: '{o}', Action {first + k}: '{a}']" for k, (o, a) in enumerate(history)
    )
    text = TEMPLATE.format(task_description=task, step_count=step_count, history_length=len(history),
                           action_history=action_history, current_step=step_count + 1,
                           current_observation=observation, available_actions=actions)
    return no_history if len(text) > MAX_PROMPT_CHARS else text


# ---- parse ----------------------------------------------------------------------------------
def parse(response: str) -> tuple[str, bool]:
    """verl-agent's WebShop projection: the text in <action></action>, else the last 20 chars."""
    return verl_projection(response, tail_chars=20)


def answer(thought: str, action: str) -> str:
    """The answer format parse() reads: <think>thought</think> then <action>action</action>."""
    return verl_answer(thought, action)
