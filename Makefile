# deepzero: two commands on a fresh machine —  `make train`  and  `make test`.
PYTHON    ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
# On a CUDA machine pip takes the CUDA build of this version; here it takes the CPU wheel on disk.
TORCH_SPEC ?= torch==2.13.0
NUM_GPUS  ?= 3
DS_CONFIG ?= ds_configs/zero2.json
DATA      ?= artifacts/data/stdlib
SEQ_LEN   ?= 256
OUT       ?= runs/default
TRAIN_ARGS ?=
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers (a file's tests stay together on one): launches and
# single-threaded in-process tests fill each other's idle CPU. 1 runs the suite in one process.
TEST_WORKERS ?= 2
# The accelerator is named, not guessed (DeepSpeed warns on every process when it falls back to the CPU; torch tells
# CUDA and ROCm cards alike), and the
# launcher logs errors only (its INFO lines and "Unable to find hostfile" say nothing about a one-machine run).
ACCELERATOR ?= $(shell $(BIN)/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
LAUNCH = PATH="$(CURDIR)/$(BIN):$$PATH" DS_ACCELERATOR=$(ACCELERATOR) deepspeed --log_level=error --num_gpus=$(NUM_GPUS)

.PHONY: setup lighteval data train sft sft-long dpo grpo grpo-math grpo-code eval eval-code sample test lint plan doctor plot bench bench-gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m deepzero.op_builds
	touch $@

# Embedded default data: the Python standard library's own source, with a BPE tokenizer trained on it here.
data: setup
	$(BIN)/python data/prepare.py --input stdlib --tokenizer train --vocab-size 4096 --seq-len $(SEQ_LEN) --out $(DATA)

train: data
	$(LAUNCH) train.py \
		--deepspeed_config $(DS_CONFIG) --data $(DATA) --out $(OUT) $(TRAIN_ARGS)

# Chat SFT example (docs/sft.md): Q&A chats from the stdlib's docstrings, DeepSeek's tokenizer and chat template
# (SFT_TOKENIZER=train: a BPE trained here instead), document-masked packing, assistant-only targets, ZeRO-2.
SFT_DATA      ?= artifacts/data/sft_example
SFT_TOKENIZER ?= artifacts/tokenizers/deepseek
SFT_OUT       ?= runs/sft
SFT_ARGS      ?= --max-steps 40 --warmup-steps 4 --micro-batch 2 --grad-accum 1 --log-interval 2 \
	--eval-interval 20 --eval-batches 1 --save-interval 0
sft: setup
	$(BIN)/python data/sft_example.py --out $(SFT_DATA).jsonl
	$(BIN)/python data/tokenizer.py deepseek --out artifacts/tokenizers/deepseek
	$(BIN)/python data/prepare.py --input $(SFT_DATA).jsonl --format chat --tokenizer $(SFT_TOKENIZER) \
		--seq-len $(SEQ_LEN) --val-fraction 0.05 --out $(SFT_DATA)
	$(LAUNCH) train.py \
		--deepspeed_config $(DS_CONFIG) --data $(SFT_DATA) --out $(SFT_OUT) $(SFT_ARGS)

# Long-sequence chat SFT (docs/sft.md): R1-style <think> traces made from the stdlib's source (0.5k-14k tokens each),
# DeepSeek's tokenizer (129,280 ids), 4,096-token rows, trained with the long-sequence defaults (tiled loss) plus
# activation checkpointing. SFT_LONG_ARGS="--tiled-loss off" (and no checkpointing) is the comparison run.
SFT_LONG_DATA ?= artifacts/data/sft_long_example
SFT_LONG_SEQ  ?= 4096
SFT_LONG_OUT  ?= runs/sft-long
SFT_LONG_ARGS ?= --gradient-checkpointing --max-steps 12 --warmup-steps 2 --micro-batch 1 --grad-accum 1 \
	--log-interval 2 --eval-interval 6 --eval-batches 1 --save-interval 0
sft-long: setup
	$(BIN)/python data/sft_long_example.py --out $(SFT_LONG_DATA).jsonl
	$(BIN)/python data/tokenizer.py deepseek --out artifacts/tokenizers/deepseek
	$(BIN)/python data/prepare.py --input $(SFT_LONG_DATA).jsonl --format chat --tokenizer artifacts/tokenizers/deepseek \
		--seq-len $(SFT_LONG_SEQ) --val-fraction 0.1 --out $(SFT_LONG_DATA)
	$(LAUNCH) train.py \
		--deepspeed_config $(DS_CONFIG) --data $(SFT_LONG_DATA) --out $(SFT_LONG_OUT) $(SFT_LONG_ARGS)

# The fine-tuning examples below (dpo, grpo, grpo-math, grpo-code) keep the constant lr after the warm-up that their
# documented figures were measured with; a fine-tune decays by cosine unless told (docs/schedules.md).

# Preference tuning example (docs/preference.md): pairs made from the SFT example (chosen: the function's own
# docstring answer; rejected: the answer about a member of a module never asked about), DPO (sigmoid) from the
# `make sft` export, reference log-probs precomputed once by the starting weights. Runs `make sft` first when its
# export is missing. `make plot OUT=runs/dpo` draws the rewards.
DPO_DATA  ?= artifacts/data/dpo_example
DPO_MODEL ?= $(SFT_OUT)/hf
DPO_OUT   ?= runs/dpo
DPO_ARGS  ?= --max-steps 60 --warmup-steps 5 --lr 2e-4 --lr-schedule constant --micro-batch 2 --grad-accum 1 --log-interval 5 \
	--eval-interval 20 --eval-batches 2 --save-interval 0
dpo: setup
	test -f $(DPO_MODEL)/config.json || $(MAKE) sft
	$(BIN)/python data/dpo_example.py --out $(DPO_DATA).jsonl
	$(BIN)/python data/prepare.py --input $(DPO_DATA).jsonl --format preference --tokenizer $(DPO_MODEL) \
		--seq-len $(SEQ_LEN) --val-fraction 0.1 --out $(DPO_DATA)
	$(LAUNCH) train.py \
		--deepspeed_config $(DS_CONFIG) --model $(DPO_MODEL) --data $(DPO_DATA) --out $(DPO_OUT) $(DPO_ARGS)

# GRPO example (docs/grpo.md): prompts are the stdlib's `def` lines, the reward is the share of the letter in each
# record's `letter` column among the completion's characters (data/grpo_reward.py, TRL's signature), trained from
# the `make train` export (runs it first when missing). The held-out mean reward (greedy completions of the val
# prompts) is printed before and after.
GRPO_DATA  ?= artifacts/data/grpo_example
GRPO_MODEL ?= $(OUT)/hf
GRPO_OUT   ?= runs/grpo
GRPO_ARGS  ?= --max-steps 30 --warmup-steps 2 --lr 2e-3 --lr-schedule constant --num-generations 4 --micro-batch 4 --grad-accum 1 \
	--max-completion-length 24 --log-interval 3 --eval-interval 15 --eval-batches 4 --save-interval 0
grpo: setup
	test -f $(GRPO_MODEL)/config.json || $(MAKE) train
	$(BIN)/python data/grpo_example.py --out $(GRPO_DATA).jsonl
	$(BIN)/python data/prepare.py --input $(GRPO_DATA).jsonl --format prompts --tokenizer $(GRPO_MODEL) \
		--seq-len 64 --max-completion-length 24 --val-fraction 0.05 --out $(GRPO_DATA)
	$(BIN)/python data/grpo_example.py --score $(GRPO_MODEL) --data $(GRPO_DATA)
	$(LAUNCH) train.py --deepspeed_config $(DS_CONFIG) \
		--model $(GRPO_MODEL) --data $(GRPO_DATA) --out $(GRPO_OUT) --reward data/grpo_reward.py:letter_share $(GRPO_ARGS)
	$(BIN)/python data/grpo_example.py --score $(GRPO_OUT)/hf --data $(GRPO_DATA)

# Math GRPO example (docs/grpo.md): R1's order at toy size. Every sum a + b of 0..19; a cold-start SFT on half of them
# answered as `a + b = $\boxed{c}$` (a BPE trained on the chats), then GRPO from that export on all 400 questions with
# --reward accuracy (TRL's accuracy_reward: math-verify checks the boxed answer against the record's answer).
MATH_SFT      ?= artifacts/data/math_sft
MATH_PROMPTS  ?= artifacts/data/math_prompts
MATH_SFT_OUT  ?= runs/math-sft
MATH_OUT      ?= runs/math-grpo
MATH_SFT_ARGS ?= --max-steps 300 --warmup-steps 5 --micro-batch 4 --grad-accum 1 --log-interval 50 \
	--eval-interval 100 --eval-batches 1 --save-interval 0
MATH_ARGS     ?= --reward accuracy --num-generations 8 --micro-batch 8 --grad-accum 1 --max-steps 150 \
	--warmup-steps 2 --lr 2e-4 --lr-schedule constant --log-interval 10 --eval-interval 30 --eval-batches 10 \
	--eval-sampling r1 --save-interval 0
grpo-math: setup
	$(BIN)/python data/math_example.py --sft $(MATH_SFT).jsonl --prompts $(MATH_PROMPTS).jsonl
	$(BIN)/python data/prepare.py --input $(MATH_SFT).jsonl --format chat --tokenizer train --vocab-size 300 \
		--seq-len 48 --val-fraction 0.1 --out $(MATH_SFT)
	$(LAUNCH) train.py --deepspeed_config $(DS_CONFIG) --data $(MATH_SFT) --out $(MATH_SFT_OUT) $(MATH_SFT_ARGS)
	$(BIN)/python data/prepare.py --input $(MATH_PROMPTS).jsonl --format prompts --tokenizer $(MATH_SFT_OUT)/hf \
		--seq-len 48 --max-completion-length 16 --val-fraction 0.1 --out $(MATH_PROMPTS)
	$(LAUNCH) train.py --deepspeed_config $(DS_CONFIG) --model $(MATH_SFT_OUT)/hf --data $(MATH_PROMPTS) \
		--out $(MATH_OUT) $(MATH_ARGS)

# Evaluate as DeepSeek reports R1 (docs/evaluate.md): pass@1 over 8 samples at T 0.6 / top-p 0.95, pass@k, cons@8,
# of `make grpo-math`'s cold start (before) and its GRPO export (after) on the held-out questions, 3 ranks. The jobs
# resume: a second `make eval` only rewrites the summaries; another model or setting into the same folder is refused.
EVAL_BEFORE ?= $(MATH_SFT_OUT)/hf
EVAL_AFTER  ?= $(MATH_OUT)/hf
EVAL_DATA   ?= $(MATH_PROMPTS)
EVAL_OUT    ?= runs/eval
EVAL_ARGS   ?= --reward accuracy --protocol r1 --samples 8
eval: setup
	test -f $(EVAL_AFTER)/config.json || $(MAKE) grpo-math
	$(LAUNCH) evaluate.py --model $(EVAL_BEFORE) --data $(EVAL_DATA) --out $(EVAL_OUT)/before --resume $(EVAL_ARGS)
	$(LAUNCH) evaluate.py --model $(EVAL_AFTER) --data $(EVAL_DATA) --out $(EVAL_OUT)/after --resume $(EVAL_ARGS)
	$(BIN)/python -m deepzero.rollout.compare $(EVAL_OUT)/before $(EVAL_OUT)/after

# Rejection sampling (docs/evaluate.md): 8 samples of each training question from `make grpo-math`'s export, the
# correct ones (deduplicated, 2 a question at most) as chat SFT data, prepared for train.py.
RS_OUT  ?= artifacts/rs/math_round1.jsonl
RS_DATA ?= artifacts/data/math_rs
RS_ARGS ?= --reward accuracy --samples 8 --keep 'accuracy>=1' --per-prompt 2
sample: setup
	test -f $(EVAL_AFTER)/config.json || $(MAKE) grpo-math
	$(LAUNCH) sample.py --model $(EVAL_AFTER) --data $(EVAL_DATA) --split train --out $(RS_OUT) --resume $(RS_ARGS)
	$(BIN)/python data/prepare.py --input $(RS_OUT) --format chat --tokenizer $(EVAL_AFTER) --seq-len 48 \
		--val-fraction 0.1 --out $(RS_DATA)

# Code GRPO example (docs/code.md): 200 tasks `def answer_N():` whose test wants N; a cold start on half of them written
# out (plain text, a BPE trained on it), then GRPO from that export on every task with --reward code (the program and
# its test run in the sandbox); `make eval-code` compares the held-out pass@1 before and after.
CODE_SFT      ?= artifacts/data/code_sft
CODE_PROMPTS  ?= artifacts/data/code_prompts
CODE_SFT_OUT  ?= runs/code-sft
CODE_OUT      ?= runs/code-grpo
CODE_SFT_ARGS ?= --max-steps 300 --warmup-steps 5 --micro-batch 4 --grad-accum 1 --log-interval 50 \
	--eval-interval 100 --eval-batches 1 --save-interval 0
CODE_ARGS     ?= --reward code --num-generations 8 --micro-batch 8 --grad-accum 1 --max-steps 150 \
	--warmup-steps 2 --lr 2e-4 --lr-schedule constant --log-interval 10 --eval-interval 30 --eval-batches 10 \
	--eval-sampling r1 --save-interval 0
grpo-code: setup
	$(BIN)/python data/code_example.py --sft $(CODE_SFT).jsonl --prompts $(CODE_PROMPTS).jsonl
	$(BIN)/python data/prepare.py --input $(CODE_SFT).jsonl --format text --tokenizer train --vocab-size 300 \
		--seq-len 32 --val-fraction 0.1 --out $(CODE_SFT)
	$(LAUNCH) train.py --deepspeed_config $(DS_CONFIG) --data $(CODE_SFT) --out $(CODE_SFT_OUT) $(CODE_SFT_ARGS)
	$(BIN)/python data/prepare.py --input $(CODE_PROMPTS).jsonl --format prompts --tokenizer $(CODE_SFT_OUT)/hf \
		--seq-len 24 --max-completion-length 8 --val-fraction 0.1 --out $(CODE_PROMPTS)
	$(LAUNCH) train.py --deepspeed_config $(DS_CONFIG) --model $(CODE_SFT_OUT)/hf --data $(CODE_PROMPTS) \
		--out $(CODE_OUT) $(CODE_ARGS)

CODE_EVAL_OUT ?= runs/eval-code
eval-code: setup
	test -f $(CODE_OUT)/hf/config.json || $(MAKE) grpo-code
	$(LAUNCH) evaluate.py --model $(CODE_SFT_OUT)/hf --data $(CODE_PROMPTS) --out $(CODE_EVAL_OUT)/before --resume \
		--reward code --samples 8
	$(LAUNCH) evaluate.py --model $(CODE_OUT)/hf --data $(CODE_PROMPTS) --out $(CODE_EVAL_OUT)/after --resume \
		--reward code --samples 8
	$(BIN)/python -m deepzero.rollout.compare $(CODE_EVAL_OUT)/before $(CODE_EVAL_OUT)/after

# lighteval 0.13 in its own venv (it pins latex2sympy2_extended 1.0.6, math-verify 0.9 pins 1.11.0): the benchmark
# verdicts (evaluate.py / deepzero.score --benchmark) come from its own metric code (docs/evaluate.md). About 2 GB.
LIGHTEVAL_VENV := .venv-lighteval
lighteval: $(LIGHTEVAL_VENV)/.installed

$(LIGHTEVAL_VENV)/.installed:
	test -x $(LIGHTEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LIGHTEVAL_VENV)
	$(LIGHTEVAL_VENV)/bin/python -m pip install -q --upgrade pip
	$(LIGHTEVAL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LIGHTEVAL_VENV)/bin/python -m pip install -q "lighteval==0.13.0"
	touch $@

test: setup lighteval
	$(BIN)/python -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS) tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

MODEL ?= deepseek-coder-1.3b
plan: setup
	$(BIN)/python -m deepzero.plan --model $(MODEL) --gpus $(NUM_GPUS) --gpu-mem 24 --cpu-mem 128 --seq-len 2048

doctor: setup
	$(BIN)/python -m deepzero.doctor --checkpoint-dir $(dir $(OUT)) $(DOCTOR_ARGS)

# Loss curves and tokens/s of a run (default: the last `make train`) as one PNG.
plot: setup
	$(BIN)/python -m deepzero.plot $(OUT)/metrics.jsonl -o $(OUT)/curves.png

# CPU benchmarks (not tests; each run first waits for a quiet machine): results in bench/results/ and docs/performance.md.
bench: data
	$(BIN)/python -m bench.compare_loops && $(BIN)/python -m bench.scaling && $(BIN)/python -m bench.experts_impl

# The prepared one-card GPU benchmark (matmul ceiling, dense and MoE MFU), under 8 minutes.
bench-gpu: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" bench/gpu.sh

clean:
	rm -rf runs artifacts .pytest_cache
