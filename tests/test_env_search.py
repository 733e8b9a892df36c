"""Search QA adapter and its BM25 retrieval server, on the shared Search-R1 / FlashRAG data.

The server is started here, as users start it (`python -m envs.search serve`), on a free
loopback port in a subprocess, and stopped at the end.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("bm25s", reason="bm25s not installed: pip install bm25s")

import envs  # noqa: E402
from envs import search  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "search_qa"
CORPUS = DATA / "corpus" / "wiki18_searchr1_retrieved_passages.jsonl"
TRAJECTORIES = DATA / "trajectories" / "search_r1_base_bamboogle_intermediate_data.json"
pytestmark = pytest.mark.skipif(not CORPUS.exists(), reason=f"shared search QA data not found at {DATA}")
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "envs.search", "serve", "--corpus", str(CORPUS), "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = proc.stdout.readline()  # printed once the index is built and the socket is bound
        assert "serving" in banner, banner + proc.stdout.read()
        yield f"http://127.0.0.1:{port}/retrieve", banner
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_server_binds_loopback_and_answers_in_search_r1_shape(server):
    url, banner = server
    assert f"serving {url}" in banner and "indexed 9655 passages" in banner
    out = post(url, {"query": "who got the first nobel prize in physics", "topk": 3, "return_scores": True})
    assert len(out["result"]) == 1 and len(out["result"][0]) == 3
    top = out["result"][0][0]
    assert top["document"]["contents"].startswith('"Nobel Prize in Physics"\n') and isinstance(top["score"], float)
    scores = [r["score"] for r in out["result"][0]]
    assert scores == sorted(scores, reverse=True)
    batch = post(url, {"queries": ["capital of france", "nobel prize"], "topk": 2})  # Search-R1's own request shape
    assert len(batch["result"]) == 2 and set(batch["result"][1][0]) == {"id", "contents", "source_dataset"}


@pytest.mark.parametrize("name, readme_recall", [("nq", 64), ("triviaqa", 73), ("popqa", 48), ("bamboogle", 26)])
def test_bm25_recall_at_5_matches_the_data_readme(server, name, readme_recall):
    url, _ = server
    rows = [json.loads(line) for line in (DATA / "questions" / "flashrag_format" / f"{name}_test_subsample.jsonl").open()]
    results = post(url, {"queries": [r["question"] for r in rows], "topk": 5})["result"]
    passages = {doc["id"]: search.normalize_answer(doc["contents"]) for docs in results for doc in docs}
    hits = sum(any(search.normalize_answer(a) and search.normalize_answer(a) in passages[doc["id"]]
                   for doc in docs for a in row["golden_answers"]) for row, docs in zip(rows, results))
    recall = 100 * hits / len(rows)
    # "within a point" of the README's rounded figure; for the 125 Bamboogle questions a point is
    # under one question, so two questions of slack there (measured: 64.0, 73.1, 47.3, 24.8)
    assert abs(recall - readme_recall) <= max(1.0, 200 / len(rows))


def test_em_normalisation_on_tricky_answers():
    em = search.exact_match
    assert em("The  Beatles!", ["beatles"])          # article, punctuation, spacing
    assert em("an Apple", ["apple"])
    assert em("U.S.A.", ["usa"])
    assert em("1,000", ["1000"])
    assert em("  Paris\n", ["Lyon", "paris"])          # any gold answer
    assert em("Jean-Paul Sartre", ["jeanpaul sartre"])  # a hyphen is punctuation: removed, not a space
    assert not em("Jean-Paul Sartre", ["jean paul sartre"])
    assert not em("theater", ["ater"])                  # only whole-word articles go
    assert not em("Röntgen", ["Wilhelm Conrad Röntgen"])  # exact, not substring
    assert not em("Richard Nixon", ["james madison"])
    assert not em("", ["---"]) and not em("the", ["The The"]) and not em("!!!", ["!!!"])  # "" never matches ""
    assert not em("a", ["rotationally symmetric saltire", "*"]) and em("the symbol ×", ["symbol ×", "*"])


def test_empty_answer_does_not_win_a_question_with_a_punctuation_gold_answer(server):
    url, _ = server
    env = search.Env(data=str(DATA), url=url)
    step = env.reset("test/nq/452")  # gold answers: 'a rotationally symmetric saltire', 'the symbol ×', '*'
    assert env.answers[-1] == "*" and step.task == "what is the multiplication sign on the computer"
    for empty in ["<answer></answer>", "<answer>the</answer>", "<answer> *!? </answer>"]:
        env.reset("test/nq/452")
        assert not env.step(empty).won
    env.reset("test/nq/452")
    assert env.step("<answer>The symbol ×</answer>").won


def test_search_r1_rollouts_parse_to_their_queries_and_answers():
    items = json.loads(TRAJECTORIES.read_text())
    by_id = {item["id"]: item for item in items}

    def actions(item_id):
        return [search.parse(turn) for turn in search.model_turns(by_id[item_id]["output"]["final_response"])]

    # read off the rollouts by hand
    assert actions("test_0") == [("", False),  # "<think> ... 1970. </search>": no opening tag; Search-R1 said invalid
                                 ("<search>President of the United States in the year that Citibank was founded</search>", True),
                                 ("<answer>Richard Nixon</answer>", True)]
    assert actions("test_4") == [("<search>last king from Britain's House of Hanover died</search>", True),
                                 ("<answer>20 June 1837</answer>", True)]
    assert actions("test_7") == [("", False), ("<answer>88300</answer>", True)]  # the model wrote its own <information>
    for item in items:  # every rollout: one search per <information> the env inserted, and Search-R1's prediction
        final = item["output"]["final_response"]
        parsed = [search.parse(t)[0] for t in search.model_turns(final)]
        assert sum(a.startswith("<search>") for a in parsed) == len(re.findall(r"</search>\n\n<information>", final))
        answers = [a[len("<answer>"):-len("</answer>")] for a in parsed if a.startswith("<answer>")]
        assert (answers[-1] if answers else "") == item["output"]["pred"].strip()


def test_projection_follows_verl_agent():
    parse = search.parse
    assert parse("<think>x</think> <search> Eiffel tower height </search>") == ("<search>Eiffel tower height</search>", True)
    assert parse("<SEARCH>q</SEARCH>") == ("<search>q</search>", True)
    assert parse("<answer> Paris </answer> trailing") == ("<answer>Paris</answer>", True)
    assert parse("<search>a</search><answer>b</answer>") == ("<search>a</search>", False)  # both kinds
    assert parse("<search>a</search><search>b</search>") == ("<search>a</search>", False)  # twice
    assert parse("I think it is Paris.") == ("", False)
    assert parse("<think>x</think></search>q<search>") == ("", False)  # reversed tags: no block at all
    assert parse("<answer><answer>Paris</answer>") == ("<answer><answer>Paris</answer>", False)  # nested: a tag twice


def test_episode_rewards_exact_match(server):
    url, _ = server
    env = search.Env(data=str(DATA), url=url)
    step = env.reset("test/bamboogle/0")
    assert step.observation == step.task == "Who was president of the United States in the year that Citibank was founded?"
    assert step.task_type == "bamboogle" and step.admissible is None
    step = env.step("<search>Citibank founded 1812</search>")
    assert step.observation.startswith('<information>{"result": "Doc 1: ') and step.observation.endswith("</information>")
    assert not step.done and step.reward == 0
    step = env.step("<answer>James Madison</answer>")
    assert step.done and step.won and step.reward == 1.0 and step.score == 1.0 and "correct" in step.state
    env.reset("test/bamboogle/0")
    step = env.step("<answer>Richard Nixon</answer>")
    assert step.done and not step.won and step.reward == 0.0
    env.reset("test/bamboogle/0")
    for turn in range(4):  # never answering: the fourth turn ends the episode, EM 0
        step = env.step("")
        assert step.observation == "" and step.done == (turn == 3)
    assert not step.won


def test_evidence_state_marks_a_retrieved_gold_answer(server):
    url, _ = server
    env = search.Env(data=str(DATA), url=url)
    env.reset("test/bamboogle/4")  # When did the last king from Britain's House of Hanover die? -> 20 June 1837
    assert env.step("<search>zebra migration serengeti</search>").state == frozenset()
    assert env.step("<search>William IV died 20 June 1837 House of Hanover</search>").state == {"evidence"}


def test_reference_actions_are_a_successful_rollouts_searches_never_its_answer():
    env = search.Env(data=str(DATA))
    assert env.reference_actions("test/bamboogle/4") == ["<search>last king from Britain's House of Hanover died</search>"]
    assert env.reference_actions("test/bamboogle/0") == []  # Search-R1 got this one wrong
    assert env.reference_actions("test/bamboogle/8") == ["<search>Can people who have celiac eat camel meat</search>"]


def test_test_split_names_the_seven_sources(capsys):
    pytest.importorskip("pyarrow", reason="the 2WikiMultihopQA questions are parquet: pip install pyarrow")
    search.report_dropped.cache_clear()
    ids = search.task_ids("test", data=str(DATA))
    counts = {}
    for task_id in ids:
        counts[task_id.split("/")[1]] = counts.get(task_id.split("/")[1], 0) + 1
    # shared/data/README.md's counts, less 2 NQ and 2 HotpotQA questions that no answer can match
    assert counts == {"nq": 998, "triviaqa": 1000, "popqa": 1000, "hotpotqa": 7403, "2wikimultihopqa": 12576,
                      "musique": 2417, "bamboogle": 125}
    assert search.task_ids("test", data=str(DATA)) == ids  # listed twice (train and eval), reported once
    assert capsys.readouterr().out == (f"search: dropped 4 of 25523 questions of {DATA} (test): their gold answers "
                                       "all normalise to an empty string, so no answer can match them\n")
    # the four, found by hand: NQ '---' and ')', HotpotQA 'The The' and '!!!'; ids keep their file rows
    assert {"test/nq/493", "test/nq/710", "test/hotpotqa/3667", "test/hotpotqa/5470"}.isdisjoint(ids)
    assert {"test/nq/492", "test/nq/494", "test/nq/999", "test/hotpotqa/7404"} <= set(ids)
    nq_open = search.read_rows(DATA / "questions" / "verl_format" / "nq_test.jsonl")[0]
    assert search.question_of(nq_open, "nq") == {"question": "when was the last time anyone was on the moon",
                                                 "answers": ["14 December 1972 UTC", "December 1972"], "source": "nq"}


def test_dead_server_gives_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    env = search.Env(data=str(DATA), url=url)
    with pytest.raises(envs.EnvUnavailable, match=re.escape(url) + r".*python -m envs\.search serve"):
        env.reset("test/bamboogle/0")


def test_episode_that_fails_at_reset_is_logged_under_its_task_type():
    spec = envs.load("search", data=str(DATA), url=f"http://127.0.0.1:{free_port()}/retrieve")  # nothing listens
    with envs.EnvRunner(spec, num_workers=1) as runner:
        steps = runner.reset(["test/bamboogle/0", "test/popqa/3"])
    assert [s.crashed for s in steps] == [True, True] and "is not answering" in steps[0].observation
    assert [s.task_type for s in steps] == ["bamboogle", "popqa"]  # was "": a `success_rate_` metric key


QUESTIONS = DATA / "questions" / "flashrag_format" / "flashrag_quickstart_nq_test.jsonl"  # 17 NQ questions
TINY_RUN = ["--env", "search", "--env-data", str(QUESTIONS), "--num-tasks", "2", "--group-size", "2", "--max-steps", "2",
            "--max-new-tokens", "8", "--num-eval-tasks", "2", "--num-env-workers", "2", "--minibatch-size", "4",
            "--no-gradient-checkpointing", "--total-iterations", "2"]


def test_dead_search_server_stops_the_run_before_the_model_loads(tiny_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    out = subprocess.run([sys.executable, "grpo.py", "--model", tiny_model, *TINY_RUN, "--search-url", url,
                          "--output-dir", str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: retrieval server {url} is not answering (")
    assert out.stderr.strip().endswith("start one: python -m envs.search serve --corpus FILE --port 8000")
    assert not (tmp_path / "runs").exists()  # no run directory, no checkpoint


def test_run_stops_when_most_episodes_of_an_iteration_crash(tiny_model, tmp_path):
    """The server answers the probe, then dies: every episode crashes; the run stops at iteration 1
    with one line instead of training on them and saving a checkpoint."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "envs.search", "serve", "--corpus", str(CORPUS), "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "serving" in server.stdout.readline()
    run = subprocess.Popen([sys.executable, "grpo.py", "--model", tiny_model, *TINY_RUN, "--eval-every", "1",
                            "--search-url", f"http://127.0.0.1:{port}/retrieve", "--output-dir", str(tmp_path / "runs")],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in run.stdout:
            if line.startswith("env search: started"):
                break
        server.terminate()
        server.wait(timeout=30)
        stdout, stderr = run.communicate(timeout=900)
    finally:
        server.kill()
        run.kill()
    assert line.startswith("env search: started train/nq/0 in ") and line.rstrip().endswith("s (17 tasks)")
    assert run.returncode == 2 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == ("error: 4 of 4 episodes of this iteration crashed (see the warnings "
                                               "above): the env is failing; stopping rather than training on them")
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0]  # the first evaluation, then no update and no iteration logged
    assert rows[0]["eval/env_crashes"] == 2 and "eval/success_rate_nq" in rows[0] and "eval/success_rate_" not in rows[0]
    assert not [p for p in run_dir.iterdir() if p.name.startswith("checkpoint")]


def test_check_command_passes_with_gold_answers(server, capsys):
    url, _ = server
    spec = envs.load("search", data=str(DATA), url=url)
    assert search.check(spec, "test", 3) == 0
    assert "3/3 gold answers scored EM 1" in capsys.readouterr().out


def test_prompt_renders_search_memory():
    assert search.prompt("Who?", "Who?", None, [], 0, 4).startswith(
        "\nYou are an expert agent tasked with answering the given question step-by-step.\nYour question: Who?\n\n"
        "Now it's your turn to respond for the current step.\n")
    history = [("Who?", "<search>q1</search>"), ("<information>r1</information>", "<search>q2</search>")]
    text = search.prompt("Who?", "<information>r2</information>", None, history, 2, 4)
    assert ("Prior to this step, you have already taken 2 step(s). Below is the interaction history where <search> </search> "
            "wrapped your past search queries and <information> </information> wrapped the corresponding search results "
            "returned by the external search engine. History:\n"
            "Step 1:<search>q1</search> <information>r1</information>\n\n"
            "Step 2:<search>q2</search> <information>r2</information>\n\n\n") in text
