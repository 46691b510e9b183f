"""Issue 48's real client: EleutherAI's lm-evaluation-harness (`lm_eval`, its `local-completions`
model (and `local-chat-completions` for generation), the tokenizer found through the server's /tokenizer_info and /tokenize as it detects them)
against `kvbridge up` (proxy, P and D processes, NIXL, the default model) and against one instance
serving by itself (the cluster's D, asked directly: colocated). Two local tasks: a multiple-choice one
(loglikelihood: echo + logprobs, lm-eval's batches of 4 as prompt lists of token ids) and a
generation one (generate_until, batches of 4). Through P/D the accuracy equals the colocated
server's, each choice's loglikelihood is within tolerance and the generations are the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvbridge.launcher.cluster import LocalCluster

MODEL = "SmolLM2-135M-Instruct"
DATA = Path(__file__).resolve().parent.parent / "data" / "lm_eval"
LOGLIKELIHOOD_ATOL = 1e-3  # P (through P/D) and D (alone) compute the same prompt the same way

pytestmark = pytest.mark.timeout(600)

TASKS = {
    "kvb_mc": """task: kvb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/kvb_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "kvb_gen": """task: kvb_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/kvb_gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
""",
}


def evaluate(base_url: str, out: Path, tasks_dir: Path, chat: bool = False,
             ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """lm_eval's own command line against `base_url`: its results and its logged samples per task.
    `chat`: its local-chat-completions model on the generation task (chat has no loglikelihood)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if chat:
        model = ["--model", "local-chat-completions", "--apply_chat_template",
                 "--model_args", f"model={MODEL},base_url={base_url}/v1/chat/completions,num_concurrent=1,max_retries=1"]
        tasks = ["kvb_gen"]
    else:
        model = ["--model", "local-completions", "--batch_size", "4",
                 "--model_args", f"model={MODEL},base_url={base_url}/v1/completions,num_concurrent=1,max_retries=1,"
                                 "tokenized_requests=True"]
        tasks = list(TASKS)
    command = [sys.executable, "-m", "lm_eval", *model, "--tasks", ",".join(tasks), "--include_path", str(tasks_dir),
               "--output_path", str(out), "--log_samples"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stderr[-4000:]
    if not chat:
        assert "Using remote tokenizer" in run.stderr  # the tokenizer came from the server (/tokenizer_info)
    (results_file,) = out.rglob("results_*.json")
    samples = {task: [json.loads(line) for f in out.rglob(f"samples_{task}_*.jsonl")
                      for line in f.read_text().splitlines()] for task in tasks}
    return json.loads(results_file.read_text()), samples


def test_lm_eval_through_pd_equals_colocated(smollm2_pd_cluster: LocalCluster, tmp_path: Path) -> None:
    c = smollm2_pd_cluster
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    for name, text in TASKS.items():
        (tasks_dir / f"{name}.yaml").write_text(text.format(data=DATA))
    pd_results, pd_samples = evaluate(c.urls.proxy, tmp_path / "pd", tasks_dir)
    alone_results, alone_samples = evaluate(c.urls.decode[0], tmp_path / "alone", tasks_dir)

    mc, alone_mc = pd_results["results"]["kvb_mc"], alone_results["results"]["kvb_mc"]
    assert mc["acc,none"] == alone_mc["acc,none"] and mc["acc,none"] >= 0.5  # the model knows most of these
    assert len(pd_samples["kvb_mc"]) == len(alone_samples["kvb_mc"]) == 16
    by_doc = {s["doc_id"]: s for s in alone_samples["kvb_mc"]}
    for sample in pd_samples["kvb_mc"]:
        got = [float(ll) for ll, _ in sample["filtered_resps"]]  # logged as text
        want = [float(ll) for ll, _ in by_doc[sample["doc_id"]]["filtered_resps"]]
        assert got == pytest.approx(want, abs=LOGLIKELIHOOD_ATOL), sample["doc_id"]
        assert all(ll < 0 for ll in got), sample["filtered_resps"]

    gen, alone_gen = pd_results["results"]["kvb_gen"], alone_results["results"]["kvb_gen"]
    assert gen["exact_match,none"] == alone_gen["exact_match,none"]
    by_doc = {s["doc_id"]: s for s in alone_samples["kvb_gen"]}
    assert len(pd_samples["kvb_gen"]) == 8
    for sample in pd_samples["kvb_gen"]:
        assert sample["filtered_resps"] == by_doc[sample["doc_id"]]["filtered_resps"], sample["doc_id"]

    chat_results, chat_samples = evaluate(c.urls.proxy, tmp_path / "chat", tasks_dir, chat=True)
    assert "exact_match,none" in chat_results["results"]["kvb_gen"]
    answers = [s["filtered_resps"][0] for s in chat_samples["kvb_gen"]]
    assert len(answers) == 8 and all(isinstance(a, str) and a.strip() for a in answers)  # every prompt answered
