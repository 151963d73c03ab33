"""evaluate.py and sample.py (deepzero.rollout.jobs) on a tiny model: the same samples on any world size and batch,
after a resumed job, on the layer placement, and in train.py's GRPO eval; rejection-sampled data that prepares and
trains; bad input in one line."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, cpu_env, launch, records

REWARD_FILE = """
def raises(prompts, completions, completion_ids, **kw):
    raise ValueError("no answers today")


def first_even(prompts, completions, completion_ids, log_extra=None, **kw):
    # a random model's completions: right (1.0) when their first digit is even; that digit is the answer they vote on
    first = [next((ch for ch in c if ch.isdigit()), None) for c in completions]
    if log_extra is not None:
        log_extra("answer_parsed", [d or "[unparseable]" for d in first])
    return [float(d is not None and int(d) % 2 == 0) for d in first]
"""


@pytest.fixture(scope="module")
def ev(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """80 different sums "a+b=" with their answers (prepared with --format prompts, about 12 held out, a BPE trained
    here), and a tiny random Qwen2 of three layers saved with that tokenizer (its projections multiples of 32 wide,
    as bitsandbytes' CPU kernels need)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("evaluate")
    rng = random.Random(0)
    pairs = rng.sample([(a, b) for a in range(10) for b in range(10)], 80)  # each prompt once
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD_FILE)
    cmd = [sys.executable, "data/prepare.py", "--input", str(root / "p.jsonl"), "--format", "prompts"]
    cmd += ["--tokenizer", "train", "--vocab-size", "300", "--seq-len", "24", "--max-completion-length", "8"]
    cmd += ["--val-fraction", "0.15", "--out", str(root / "data")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cpu_env())
    assert proc.returncode == 0, proc.stderr
    tok = AutoTokenizer.from_pretrained(root / "data" / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    val = json.loads((root / "data" / "meta.json").read_text())["n_rows"]["val"]
    return {"root": root, "data": root / "data", "model": root / "model", "reward": root / "reward.py", "val": val}


def job(ev: dict, out: Path, *extra: str, reward: str = "exact") -> list[str]:
    """evaluate.py's / sample.py's flags; ``reward`` "first_even" is the fixture's file reward."""
    spec = f"{ev['reward']}:first_even" if reward == "first_even" else reward
    return ["--model", str(ev["model"]), "--data", str(ev["data"]), "--reward", spec, "--out", str(out), *extra]


def run_py(script: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True, text=True, env=cpu_env())


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_rank(ev: dict) -> Path:
    """The reference job: 1 rank, 5 prompts per call, 6 samples a prompt at R1's sampling."""
    out = ev["root"] / "one"
    proc = run_py("evaluate.py", job(ev, out, "--samples", "6", "--prompts-per-call", "5", reward="first_even"))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.launcher
def test_three_ranks_and_other_batches_write_the_same_samples_and_summary(ev: dict, one_rank: Path) -> None:
    out = ev["root"] / "three"
    launch(job(ev, out, "--samples", "6", "--prompts-per-call", "2", reward="first_even"), script="evaluate.py")
    assert lines(out / "samples.jsonl") == lines(one_rank / "samples.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    alone = json.loads((one_rank / "summary.json").read_text())
    assert summary.pop("run")["ranks"] == 3 and alone.pop("run")["ranks"] == 1  # this invocation's speed, layout
    assert summary == alone
    assert {"pass@1", "pass@2", "pass@4", "cons@6", "mean_reward", "prompts"} <= set(summary)
    assert summary["prompts"] == ev["val"] and summary["temperature"] == 0.6 and summary["top_p"] == 0.95
    assert 0 < summary["pass@1"] < summary["pass@6"]  # the figures are not all 0
    # a random model's samples mostly hold no digit: "no answer" outvotes the rest, so cons@6 is 0 (lighteval's rule)
    assert summary["cons@6"] == 0 and summary["samples_unscored"] == 0
    again = launch(job(ev, out, "--samples", "6"), script="evaluate.py", check=False)  # no --resume: refused
    assert again.returncode == 2 and "Traceback" not in again.stderr
    errors = [x for x in again.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and "pass --resume to continue it" in errors[0], again.stderr  # once, by rank 0
    first = lines(out / "samples.jsonl")[0]
    assert len(first["completions"]) == 6 and len(first["rewards"]) == 6 and first["index"] == 0
    assert len(set(first["completions"])) > 1  # sampled, not six copies of one


def test_a_stopped_job_resumes_to_the_same_file_and_a_changed_one_is_refused(ev: dict, one_rank: Path) -> None:
    out = ev["root"] / "resumed"
    out.mkdir()
    for name in ("job.json", "samples.jsonl"):
        (out / name).write_bytes((one_rank / name).read_bytes())
    done = (one_rank / "samples.jsonl").read_text().splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(done[:5]) + done[5][:40])  # killed while writing line 6
    again = run_py("evaluate.py", job(ev, out, "--samples", "6", "--prompts-per-call", "3", reward="first_even"))
    assert again.returncode == 2 and "pass --resume to continue it" in again.stderr.strip().splitlines()[-1]
    changed = run_py(
        "evaluate.py", job(ev, out, "--samples", "6", "--temperature", "0.7", "--resume", reward="first_even")
    )
    assert changed.returncode == 2
    assert "error: --resume" in changed.stderr and "temperature was 0.6, now 0.7" in changed.stderr
    for flags, line in [
        (["--correct", "reward>=0.5"], "correct was None, now 'reward>=0.5'"),
        (["--dtype", "bf16"], "dtype was 'fp32', now 'bf16'"),
    ]:
        other = run_py("evaluate.py", job(ev, out, "--samples", "6", "--resume", *flags, reward="first_even"))
        assert other.returncode == 2 and line in other.stderr and "Traceback" not in other.stderr, other.stderr
    other = run_py("evaluate.py", job(ev, out, "--samples", "6", "--resume", reward="exact"))
    assert other.returncode == 2 and "reward was [" in other.stderr
    resumed = run_py(
        "evaluate.py", job(ev, out, "--samples", "6", "--prompts-per-call", "3", "--resume", reward="first_even")
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"{ev['val']} prompts, {ev['val'] - 5} to do" in resumed.stdout
    assert lines(out / "samples.jsonl") == lines(one_rank / "samples.jsonl")


def test_a_bf16_job_records_its_batch_layout_and_refuses_another_on_resume(ev: dict, tmp_path: Path) -> None:
    """In bf16 a sample depends on the rows batched with it (docs/evaluate.md): the job records its layout and a
    resume with another --prompts-per-call is one line naming it; one prompt a call leaves the rank count free."""
    out, bf16 = tmp_path / "bf16", ["--samples", "2", "--dtype", "bf16", "--limit", "4"]
    first = run_py("evaluate.py", job(ev, out, *bf16, "--prompts-per-call", "2"))
    assert first.returncode == 0, first.stderr
    saved = json.loads((out / "job.json").read_text())
    assert saved["dtype"] == "bf16" and saved["batch_layout"] == {
        "layout": "data-parallel", "rows_per_call": None, "prompts_per_call": 2, "ranks": 1,
    }  # fmt: skip
    other = run_py("evaluate.py", job(ev, out, *bf16, "--resume"))
    assert other.returncode == 2 and "Traceback" not in other.stderr
    (line,) = [x for x in other.stderr.splitlines() if x.startswith("error:")]
    assert "batch_layout was" in line and "in 16 bits a sample depends on the rows batched with it" in line
    assert line.endswith("Fix: run on 1 rank(s) with --prompts-per-call 2, or another --out")
    single = tmp_path / "single"
    ok = run_py("evaluate.py", job(ev, single, *bf16, "--prompts-per-call", "1"))
    assert ok.returncode == 0, ok.stderr
    assert "ranks" not in json.loads((single / "job.json").read_text())["batch_layout"]


def test_greedy_on_the_layer_placement_equals_the_whole_model(ev: dict) -> None:
    outs = {}
    for layout in ("data-parallel", "placement"):
        outs[layout] = ev["root"] / f"greedy-{layout}"
        proc = run_py("evaluate.py", job(ev, outs[layout], "--protocol", "greedy", "--layout", layout))
        assert proc.returncode == 0, proc.stderr
        assert f"{layout} on 1 rank(s)" in proc.stdout
    assert lines(outs["placement"] / "samples.jsonl") == lines(outs["data-parallel"] / "samples.jsonl")
    summary = json.loads((outs["placement"] / "summary.json").read_text())
    assert summary["samples_per_prompt"] == 1 and "pass@1" in summary and "cons@1" in summary


def test_the_placement_path_splits_the_model_over_three_cards(ev: dict) -> None:
    from deepzero.rollout.job_args import parse_job_args
    from deepzero.rollout.layout import load_model

    args = parse_job_args(job(ev, ev["root"] / "unused", "--layout", "placement"), "evaluate.py")
    meta = json.loads((ev["data"] / "meta.json").read_text())
    _, model = load_model(args, meta, "placement", rows=4, tokens=meta["seq_len"])
    placed = {device for name, device in model.hf_device_map.items() if name.startswith("model.layers.")}
    assert len(model._deepzero_placement_hooks) == len(model.hf_device_map) > 3 and placed == {"cpu"}
    assert sorted(n for n in model.hf_device_map if n.startswith("model.layers.")) == [
        f"model.layers.{i}" for i in range(3)
    ]


def test_the_4bit_layout_loads_the_base_in_nf4_and_evaluates(ev: dict) -> None:
    from bitsandbytes.nn import Linear4bit

    from deepzero.rollout.job_args import parse_job_args
    from deepzero.rollout.layout import load_model

    args = parse_job_args(job(ev, ev["root"] / "unused", "--layout", "data-parallel-4bit"), "evaluate.py")
    meta = json.loads((ev["data"] / "meta.json").read_text())
    _, model = load_model(args, meta, "data-parallel-4bit", rows=4, tokens=meta["seq_len"])
    assert sum(isinstance(m, Linear4bit) for m in model.modules()) == 3 * 7  # q k v o gate up down, every layer
    out = ev["root"] / "nf4"
    proc = run_py("evaluate.py", job(ev, out, "--protocol", "greedy", "--layout", "data-parallel-4bit"))
    assert proc.returncode == 0, proc.stderr
    assert "data-parallel-4bit on 1 rank(s)" in proc.stdout
    assert [line["index"] for line in lines(out / "samples.jsonl")] == list(range(ev["val"]))


def test_rejection_sampling_keeps_ended_completions_that_prepare_and_train(ev: dict) -> None:
    chat = ev["root"] / "rs" / "round1.jsonl"
    """sample.py keeps passing completions that ended (a random model's samples cut at the length limit are dropped
    and counted: no end token is ever appended to a cut one), each once, at most --per-prompt a prompt; the chat
    file prepares and trains."""
    args = job(ev, chat, "--split", "train", "--limit", "20", "--samples", "8", "--temperature", "1.5")
    proc = run_py("sample.py", [*args, "--keep", "reward>=0", "--per-prompt", "2", "--max-completion-length", "40"])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((ev["root"] / "rs" / "round1.summary.json").read_text())
    kept = lines(chat)
    assert summary["prompts_by_passing_samples"] == {"8": 20}  # every sample passes reward>=0
    sampled = lines(ev["root"] / "rs" / "round1.samples.jsonl")
    ended = [[t for t, cut in zip(x["completions"], x["truncated"], strict=True) if not cut] for x in sampled]
    assert summary["cut_dropped"] == sum(sum(x["truncated"]) for x in sampled) > 0
    assert summary["written"] == len(kept) == sum(min(len(set(e)), 2) for e in ended) > 4
    assert {r["messages"][1]["content"] for r in kept} <= {t for e in ended for t in e}
    by_prompt: dict[str, list[str]] = {}
    for record in kept:
        user, assistant = record["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        by_prompt.setdefault(user["content"], []).append(assistant["content"])
    assert all(len(v) == len(set(v)) <= 2 for v in by_prompt.values())  # deduplicated, at most --per-prompt
    data = ev["root"] / "rs" / "data"
    cmd = ["data/prepare.py", "--input", str(chat), "--format", "chat", "--tokenizer", str(ev["model"])]
    proc = subprocess.run([sys.executable, *cmd, "--seq-len", "24", "--out", str(data)], cwd=REPO, env=cpu_env())
    assert proc.returncode == 0
    out = ev["root"] / "rs" / "sft"
    train = ["--deepspeed_config", "ds_configs/zero2.json", "--model", str(ev["model"]), "--data", str(data)]
    train += ["--out", str(out), "--max-steps", "2", "--micro-batch", "2", "--grad-accum", "1", "--precision", "fp32"]
    train += ["--log-interval", "1", "--eval-interval", "0", "--save-interval", "0", "--no-export", "--lr", "1e-3"]
    launch(train, nproc=1)
    assert [r["step"] for r in records(out)] == [1, 2]


@pytest.mark.launcher
@pytest.mark.parametrize("sampling", ["r1", "greedy"])
def test_grpo_eval_samples_as_evaluate_py_does_on_the_same_weights(ev: dict, sampling: str) -> None:
    """train.py's GRPO eval (--eval-sampling r1: 4 samples a prompt, or greedy: 1; every held-out prompt, one prompt
    per eval micro-batch) and evaluate.py on its export (one prompt per call) draw the same samples: the same pass@k,
    cons@k and mean reward, though training samples with top-k, min-p and a repetition penalty evaluate.py lacks."""
    k, shape = (4, ["--num-generations", "4", "--micro-batch", "4"]) if sampling == "r1" else (1, [])
    shape = shape or ["--num-generations", "2", "--micro-batch", "1", "--grad-accum", "2"]  # eval: 1 prompt a batch
    out = ev["root"] / f"grpo-{sampling}"
    train = ["--deepspeed_config", "ds_configs/zero2.json", "--model", str(ev["model"]), "--data", str(ev["data"])]
    train += [
        "--out",
        str(out),
        "--reward",
        f"{ev['reward']}:first_even",
        *shape,
        "--max-steps",
        "2",
        "--eval-interval",
        "2",
    ]
    train += ["--eval-batches", str(ev["val"]), "--eval-sampling", sampling, "--precision", "fp32", "--lr", "1e-3"]
    train += ["--save-interval", "0", "--top-k", "5", "--min-p", "0.05", "--repetition-penalty", "1.3"]  # train only
    if "--grad-accum" not in train:
        train += ["--grad-accum", "1"]
    launch(train, nproc=1)
    (record,) = records(out, "eval")
    protocol = ["--samples", "4"] if sampling == "r1" else ["--protocol", "greedy"]
    proc = run_py("evaluate.py", job(ev, out / "eval", *protocol, "--prompts-per-call", "1", reward="first_even"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "eval" / "summary.json").read_text())
    assert summary["prompts"] == ev["val"] and 0 < summary["pass@1"] < 1  # cons@k: often 0, "no answer" wins
    for key in ("pass@1", f"pass@{k}", f"cons@{k}"):
        assert record[f"val_{key}"] == summary[key], key
    assert record["val_reward"] == pytest.approx(summary["mean_reward"], rel=1e-6)
    assert math.isfinite(record["val_loss"])  # TRL's eval loss


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ([], "error: --reward: no reward given"),
        (["--reward", "REWARD:raises"], "raised ValueError: no answers today"),
        (["--reward", "exact", "--model", "MISSING"], "error: --model"),
        (["--reward", "exact", "--pass-k", "9", "--samples", "4"], "error: --pass-k: 9 is not in 1..4"),
        (["--reward", "exact", "--protocol", "greedy", "--samples", "3"], "greedy decoding gives 3 identical"),
    ],
)
def test_bad_input_is_one_line(ev: dict, extra: list[str], line: str, tmp_path: Path) -> None:
    args = ["--model", str(ev["model"]), "--data", str(ev["data"]), "--out", str(tmp_path / "o")]
    args += [a.replace("REWARD", str(ev["reward"])).replace("MISSING", str(tmp_path / "none")) for a in extra]
    proc = run_py("evaluate.py", args)
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and line in errors[0] and "Fix:" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_documented_evaluate_and_sample_command_parses() -> None:
    """The evaluate.py / sample.py commands of README.md and docs/ name flags that exist, with valid values."""
    import shlex

    from deepzero.rollout.job_args import parse_job_args
    from tests.test_doc_commands import DOCS, shell_blocks

    found = 0
    for doc in DOCS:
        for block in shell_blocks(doc.read_text()):
            for command in block.replace("\\\n", " ").splitlines():
                if "evaluate.py" not in command and "sample.py" not in command:
                    continue
                words = shlex.split(command, comments=True)
                script = next((w for w in words if w in ("evaluate.py", "sample.py")), None)
                if script is not None:
                    parse_job_args(words[words.index(script) + 1 :], script)
                    found += 1
    assert found >= 2  # docs/evaluate.md: one of each


def test_the_summary_and_the_chat_file_stream_a_job_many_times_larger_than_their_memory(tmp_path: Path) -> None:
    """A finished job's 2,000 prompts × 8 completions of 2,000 characters (33 MB of lines): summary.json's figures
    and sample.py's chat file are made a line at a time, the Python heap's peak a small part of the file."""
    import tracemalloc

    from deepzero.rollout.jobs import JobFiles, write_chat
    from deepzero.rollout.scores import Condition, summarise

    files = JobFiles.of(str(tmp_path / "round.jsonl"), "sample")
    with files.samples.open("w") as fh:
        for i in range(2000):
            texts = [f"{i}-{j}-" + "x" * 2000 for j in range(8)]
            rewards = [float(j % 2) for j in range(8)]
            line = {"index": i, "prompt": f"q{i}", "completions": texts, "rewards": rewards, "scores": {}}
            line |= {"answers": [str(j % 3) for j in range(8)], "correct": [r >= 1 for r in rewards]}
            fh.write(json.dumps(line | {"lengths": [500] * 8, "truncated": [False] * 8}) + "\n")
    size = files.samples.stat().st_size
    tracemalloc.start()
    summary = summarise(files.lines(), [1, 8])
    figures = write_chat(files.lines(), Condition("reward", ">=", 1.0), 2, files.chat)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size > 30 * 2**20 and peak < size / 20, (size, peak)
    assert summary["prompts"] == 2000 and summary["pass@1"] == pytest.approx(0.5) and summary["pass@8"] == 1.0
    assert figures["written"] == 4000 and figures["acceptance_rate"] == 0.5
    assert len(files.chat.read_text().splitlines()) == 4000


@pytest.fixture(scope="module")
def chat_model(ev: dict) -> Path:
    """The fixture's model with a chat template on its tokenizer (benchmarks' prompts are user turns)."""
    import shutil

    from transformers import AutoTokenizer

    folder = ev["root"] / "chat-model"
    shutil.copytree(ev["model"], folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ["aime24", "gpqa_diamond", "math500", "lcb"])
def test_a_benchmark_runs_on_local_records_with_lightevals_prompt_and_cuts_long_prompts(
    ev: dict, chat_model: Path, name: str, tmp_path: Path
) -> None:
    """evaluate.py --benchmark on a local copy in the Hub layout: each prompt is lighteval's template as a user turn
    (GPQA's answers shuffled with the record's index as seed), scored by the benchmark, never by --reward; a prompt
    longer than the model's 64-token context leaves room for the completion by losing its start (counted)."""
    from deepzero.rollout import lcb
    from deepzero.rollout.benchmarks import BENCHMARKS, gpqa_choices
    from tests.helpers.lcb_cases import RECORDS as LCB
    from tests.helpers.lighteval_cases import AIME, GPQA

    math500 = [{"problem": r["problem"], "solution": f"So \\boxed{{{r['answer']}}}."} for r in AIME["records"]]
    records = {"aime24": AIME["records"], "gpqa_diamond": GPQA["records"], "math500": math500, "lcb": LCB * 2}[name][:3]
    (tmp_path / "local.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "eval"
    args = ["--model", str(chat_model), "--benchmark", name, "--data", str(tmp_path / "local.jsonl"), "--out", str(out)]
    proc = run_py("evaluate.py", [*args, "--samples", "2", "--max-completion-length", "8"])
    assert proc.returncode == 0, proc.stderr
    bench = BENCHMARKS[name]
    prepared = lines(out / "benchmark" / f"{name}.jsonl")
    query = (lambda r, i: lcb.prompt(r)) if name == "lcb" else (lambda r, i: bench.query(r, i)[0])
    assert [p["prompt"][0]["content"] for p in prepared] == [query(r, i) for i, r in enumerate(records)]
    if name == "gpqa_diamond":
        gold = gpqa_choices(records[1], 1)[1]
        assert prepared[1]["gold"] == "ABCD"[gold]
        assert f"{'ABCD'[gold]}) right 1" in prepared[1]["prompt"][0]["content"]
    elif name == "aime24":
        assert prepared[0]["prompt"][0]["content"].startswith("\nSolve the following math problem efficiently")
    elif name == "lcb":
        assert json.loads(prepared[0]["lcb_tests"])["outputs"] == ["3\n", "6\n"]  # public, then private
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == name and summary["prompts"] == 3 and summary["correct"] == f"{name}>=1"
    assert summary["max_completion_length"] == 8 and summary["prompts_cut_left"] == 3  # the templates outgrow 64
    assert "3 prompts cut from the left to fit the context" in proc.stdout
    assert all(x["prompt_cut"] > 0 and len(x["votes"]) == 2 for x in lines(out / "samples.jsonl"))
    both = run_py("evaluate.py", [*args, "--reward", "exact"])
    assert both.returncode == 2 and f"--benchmark {name}: scores as lighteval does" in both.stderr
