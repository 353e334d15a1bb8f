"""lm-evaluation-harness against `localinfer serve` (issue 44's check): its `local-completions`
model on a multiple-choice task over a small inline data set, in its default mode (token-id
prompts, made by the server's own tokenizer through /tokenize: the "remote" tokenizer it picks
when a server has one, so nothing is downloaded). Every choice's log-likelihood must be the
model's own, computed here in-process from the logits of the same file, and the accuracy the
one those figures give."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import load_file, log_probs

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct:Q4_1"
TASK = "localinfer_mc"
CLOSE = 1e-4
ITEMS = [
    {"question": "What colour is the sky on a clear day?", "choices": ["blue", "green", "red"],
     "answer": 0},
    {"question": "How many legs does a cat have?", "choices": ["two", "four", "six"],
     "answer": 1},
    {"question": "Which one is a fruit?", "choices": ["a chair", "a stone", "an apple"],
     "answer": 2},
]       # three items, each answer position once: every request is the same kind of call


@pytest.fixture(scope="module")
def server(smollm_server_512):
    return smollm_server_512


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The task as a custom task of its own folder: a JSON-lines data set and its YAML."""
    folder = tmp_path_factory.mktemp("lm_eval_task")
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return folder


def test_lm_eval_scores_are_the_models_own(server, task_dir, smollm_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")      # nothing from the Hub: it is offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    out = simple_evaluate(
        model="local-completions",
        model_args={"base_url": server + "/v1/completions", "model": MODEL,
                    "num_concurrent": 1, "max_retries": 1},
        tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True, batch_size=1)
    samples = out["samples"][TASK]
    assert len(samples) == len(ITEMS)

    from localinfer.backends import LoadOptions
    loaded = load_file(smollm_path, LoadOptions(n_ctx=512))
    try:
        right = 0
        for sample in samples:
            item = ITEMS[sample["doc_id"]]
            said = [float(r[0][0]) for r in sample["resps"]]
            mine = [loglikelihood(loaded.session, context, continuation)
                    for context, continuation in (r for r in sample["arguments"])]
            assert len(said) == len(item["choices"])
            assert np.max(np.abs(np.array(said) - np.array(mine))) < CLOSE, \
                (said, mine, sample["arguments"])
            right += int(np.argmax(mine)) == item["answer"]
    finally:
        loaded.session.close()
    assert out["results"][TASK]["acc,none"] == right / len(ITEMS)


def loglikelihood(session, context: str, continuation: str) -> float:
    """The continuation's log-probability after the context, as lm-evaluation-harness splits
    them into tokens (the whole text's tokens after the context's), each position's figure from
    the logits of an evaluation with all of them (helpers.log_probs)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:      # lm-eval moves the context's trailing spaces to the continuation
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = session.tokenize(context + continuation, special=True)
    before = session.tokenize(context, special=True)
    n = len(before)
    whole = before + whole[n:]          # what it sends, even where the two differ at the seam
    rows = log_probs(session, whole)
    return float(sum(rows[i - 1][whole[i]] for i in range(n, len(whole))))
