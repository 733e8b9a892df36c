"""WebShop adapter: observation formatting, available actions, prompt and parsing on real
WebShop text-env observations; the engine tests run only where `web_agent_site` is installed.

The observation strings below are WebAgentTextEnv(observation_mode="text") output recorded in a
public agent trajectory (the one-shot WebShop example of AgentBench / ETO): the start page, the
results of `search[l'eau d'issey 6.76 fl oz bottle price < 100.00]`, and the item page of
B000VOHH8I. The available-action dicts are what `get_available_actions()` computes for those
pages (button and product-link texts lowercased, option values as they are, in page order).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

import envs
from envs import webshop

GOAL = "i need a long lasting 6.76 fl oz bottle of l'eau d'issey, and price lower than 100.00 dollars"
START = f"WebShop [SEP] Instruction: [SEP] {GOAL} [SEP] Search"
RESULTS = (
    f"Instruction: [SEP] {GOAL} [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B000VOHH8I [SEP] "
    "L'eau D'issey By Issey Miyake for MenEau De Toilette Spray, 6.7 Fl Oz Bottle [SEP] $64.98 [SEP] B000MJZOPK [SEP] "
    "L'eau d'Issey by Issey Miyake for Women 3.3 oz Eau de Toilette Spray [SEP] $49.98 [SEP] B0012S249E [SEP] "
    "L'eau D'issey By Issey Miyake For Women. Shower Cream 6.7-Ounces [SEP] $31.36 [SEP] B01H8PGKZS [SEP] "
    "L'eau D'Issey FOR MEN by Issey Miyake - 6.7 oz EDT Spray [SEP] $67.97 [SEP] B00G3C8FHE [SEP] "
    "L'Eau d'Issey pour Homme - Eau de Toilette 4.2 fl oz [SEP] $51.25 [SEP] B000R94HRG [SEP] "
    "Issey Miyake L'Eau D'Issey Pour Homme Eau De Toilette Natural Spray [SEP] $44.99 [SEP] B000C214CO [SEP] "
    "Issey Miyake L'eau D'issey Eau de Toilette Spray for Men, 4.2 Fl Oz [SEP] $53.99 [SEP] B0018SBRDC [SEP] "
    "Issey Miyake L'eau d'Issey for Women EDT, White, 0.84 Fl Oz [SEP] $27.04 [SEP] B000XEAZ9Y [SEP] "
    "L'eau De Issey By Issey Miyake For Men. Eau De Toilette Spray 6.7 Fl Oz [SEP] $67.08 [SEP] B079HZR2RX [SEP] "
    "L'eau d'Issey Pure by Issey Miyake for Women 3.0 oz Nectar de Parfum Spray [SEP] $71.49"
)
ITEM = (
    f"Instruction: [SEP] {GOAL} [SEP] Back to Search [SEP] < Prev [SEP] size [SEP] 2.5 fl oz [SEP] 6.76 fl oz (pack of 1) [SEP] "
    "L'eau D'issey By Issey Miyake for MenEau De Toilette Spray, 6.7 Fl Oz Bottle [SEP] Price: $64.98 [SEP] "
    "Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
)
START_ACTIONS = {"has_search_bar": True, "clickables": ["search"]}
ITEM_ACTIONS = {"has_search_bar": False, "clickables": ["back to search", "< prev", "description", "features", "reviews",
                                                        "buy now", "2.5 fl oz", "6.76 fl oz (pack of 1)"]}


def test_task_is_the_instruction_of_the_start_page():
    assert webshop.task_of(START) == GOAL
    with pytest.raises(ValueError):
        webshop.task_of(RESULTS)  # only the start page opens with "WebShop [SEP] Instruction:"


def test_observations_keep_the_page_after_the_instruction_quoted():
    assert webshop.format_obs(START, GOAL) == "'Search'"
    results = webshop.format_obs(RESULTS, GOAL)
    assert results.startswith("'Back to Search' [SEP] 'Page 1 (Total results: 50)' [SEP] 'Next >' [SEP] 'B000VOHH8I' [SEP] "
                              "'L'eau D'issey By Issey Miyake for MenEau De Toilette Spray, 6.7 Fl Oz Bottle' [SEP] '$64.98'")
    assert results.count(" [SEP] ") == 32 and results.endswith("'$71.49'")  # 3 + 10 products x 3 parts
    assert webshop.format_obs(ITEM, GOAL) == (
        "'Back to Search' [SEP] '< Prev' [SEP] 'size' [SEP] '2.5 fl oz' [SEP] '6.76 fl oz (pack of 1)' [SEP] "
        "'L'eau D'issey By Issey Miyake for MenEau De Toilette Spray, 6.7 Fl Oz Bottle' [SEP] 'Price: $64.98' [SEP] "
        "'Rating: N.A.' [SEP] 'Description' [SEP] 'Features' [SEP] 'Reviews' [SEP] 'Buy Now'")
    assert webshop.format_obs("Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 0.5", GOAL) == \
        "Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 0.5"  # no instruction: unchanged


def test_available_actions_are_listed_as_verl_agent_does():
    assert webshop.format_actions(START_ACTIONS) == ["search[<your query>]", "click[search]"]
    assert webshop.format_actions(ITEM_ACTIONS) == [
        "click[back to search]", "click[< prev]", "click[description]", "click[features]", "click[reviews]",
        "click[buy now]", "click[2.5 fl oz]", "click[6.76 fl oz (pack of 1)]"]


def test_first_prompt_is_verl_agents_webshop_template():
    text = webshop.prompt(GOAL, webshop.format_obs(START, GOAL), webshop.format_actions(START_ACTIONS), [], 0, 2)
    assert text == (
        "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment. \n"
        f"Your task is to: {GOAL}.\n"
        "Your current observation is: 'Search'.\n"
        "Your admissible actions of the current situation are: \n[\n'search[<your query>]',\n'click[search]',\n].\n\n"
        "Now it's your turn to take one action for the current step.\n"
        "You should first reason step-by-step about the current situation, then think carefully which admissible action "
        "best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags. \n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and present it "
        "within <action> </action> tags.\n")


def test_later_prompts_show_history_and_fall_back_when_too_long():
    history = [("'Search'", "search[l'eau d'issey 6.76 fl oz]"), (webshop.format_obs(RESULTS, GOAL), "click[b000vohh8i]")]
    item = webshop.format_obs(ITEM, GOAL)
    text = webshop.prompt(GOAL, item, webshop.format_actions(ITEM_ACTIONS), history, 2, 2)
    assert ("Prior to this step, you have already taken 2 step(s). Below are the most recent 2 observations and the "
            "corresponding actions you took: [Observation 1: ''Search'', Action 1: 'search[l'eau d'issey 6.76 fl oz]']\n"
            "[Observation 2: ''Back to Search' [SEP] ") in text
    assert f"You are now at step 3 and your current observation is: {item}.\n" in text
    long_history = [("x" * 14_000, "click[next >]")]
    assert "Prior to this step" not in webshop.prompt(GOAL, item, [], long_history, 1, 2)


def test_parse_is_verl_agents_webshop_projection():
    assert webshop.parse("<think>the 6.7 oz one</think><action>click[B000VOHH8I]</action>") == ("click[b000vohh8i]", True)
    assert webshop.parse("<think>hm</think> click[buy now] please") == ("click[buy now] please"[-20:], False)
    assert webshop.parse("<action>click[buy now]</action>") == ("click[buy now]", False)  # no <think>


def test_state_and_its_projection():
    state = webshop.webshop_state("item_page", "B000VOHH8I", {"size": "6.76 fl oz (pack of 1)"})
    assert state == {"page:item_page", "product:b000vohh8i", "option:size=6.76 fl oz (pack of 1)"}
    plan = ["search[l'eau d'issey]", "click[b000vohh8i]", "click[6.76 fl oz (pack of 1)]", "click[buy now]"]
    assert webshop.project_state(state, GOAL, plan) == state
    other = webshop.webshop_state("item_page", "B000MJZOPK", {"size": "3.3 oz"})
    assert webshop.project_state(other, GOAL, plan) == {"page:item_page", "product:other"}
    # a search or results page is its page kind alone, whatever product was viewed before
    assert webshop.project_state(webshop.webshop_state("", None, {}), GOAL, plan) == {"page:search"}
    assert webshop.project_state(webshop.webshop_state("search_results", "B000VOHH8I", {"size": "2.5 fl oz"}), GOAL,
                                 plan) == {"page:search_results"}


def test_preset_is_verl_agents_webshop_setting():
    preset = webshop.PRESET
    assert (preset.max_steps, preset.history_length, preset.success_reward, preset.invalid_penalty) == (15, 2, 10.0, 0.1)


def test_missing_engine_names_the_install_script(tmp_path):
    if importlib.util.find_spec("web_agent_site") is not None:
        pytest.skip("web_agent_site is installed here")
    with pytest.raises(envs.EnvUnavailable, match="install_webshop.sh"):
        webshop.task_ids("test", data=str(tmp_path))
    with pytest.raises(envs.EnvUnavailable, match="install_webshop.sh"):
        webshop.Env(data=str(tmp_path)).reset("0")


ENGINE_ROOT = webshop.webshop_root(os.environ.get("WEBSHOP_ROOT"))
engine_missing = not (ENGINE_ROOT / "web_agent_site").is_dir()


@pytest.mark.skipif(engine_missing, reason=f"web_agent_site not installed at {ENGINE_ROOT} (bash scripts/install_webshop.sh)")
def test_engine_start_page_and_reference_purchase():
    assert webshop.task_ids("test") == [str(i) for i in range(500)]  # verl-agent's eval goals
    env = webshop.Env()
    plan = env.reference_actions("0")
    step = env.reset("0")
    assert step.observation == "'Search'" and step.admissible[:1] == ["search[<your query>]"]
    for action in plan:
        step = env.step(action)
    assert step.done and 0.0 <= step.score <= 1.0 and step.won == (step.score == 1.0)
