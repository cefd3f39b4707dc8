"""lm-eval's ``local-completions`` against a real `k3 serve` app (issue 12): a loglikelihood task defined from a local
file, no local tokenizer (lm-eval finds /tokenizer_info and /tokenize), scores equal to the model's own."""

from __future__ import annotations

import json

import pytest
import torch

import serving
from k3.serve.api.app import BackgroundServer, create_app
from k3.serve.engine import Engine

DOCS = [{"question": "def load(path):", "choices": [" return", " pass", " x"], "answer": 0},
        {"question": "import", "choices": [" json", " os", " sys"], "answer": 1},
        {"question": "x = 1\ny =", "choices": [" 2", " 3"], "answer": 0}]
TASK = """task: k3_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def loglikelihood(context: str, continuation: str) -> float:
    """The model's log-probability of ``continuation`` after ``context``, split into tokens as lm-eval does."""
    tok, model = serving.tokenizer(), serving.model()
    whole, n = tok.encode(context + continuation), len(tok.encode(context))
    with torch.no_grad():
        logprobs = model(torch.tensor([whole]))[0][0].double().log_softmax(-1)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(n, len(whole))))


def test_local_completions_loglikelihood_task(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "k3_local.yaml").write_text(TASK.format(data=data))
    engine = Engine(serving.model(), serving.tokenizer(), max_model_len=512).start()
    try:
        with BackgroundServer(create_app(engine, "k3-tiny")) as server:
            results = lm_eval.simple_evaluate(
                model="local-completions", model_args=f"base_url={server.url}/v1/completions,model=k3-tiny,"
                                                      "num_concurrent=2,max_retries=1",
                tasks=["k3_local"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    finally:
        engine.stop()
    samples = sorted(results["samples"]["k3_local"], key=lambda s: s["doc_id"])
    correct = 0
    for doc, sample in zip(DOCS, samples, strict=True):
        scores = [resp[0][0] for resp in sample["resps"]]
        expected = [loglikelihood(doc["question"], " " + choice) for choice in doc["choices"]]  # target_delimiter
        assert scores == pytest.approx(expected, abs=1e-3)
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert results["results"]["k3_local"]["acc,none"] == pytest.approx(correct / len(DOCS))
