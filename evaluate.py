"""Evaluate a model as DeepSeek reports R1: k samples per prompt, scored; pass@1, pass@k, cons@k.

deepspeed --num_gpus=3 evaluate.py --model runs/grpo/hf --data artifacts/data/grpo_example --reward exact --out runs/grpo/eval
deepspeed --num_gpus=3 evaluate.py --config recipes/r1-distill-qwen-7b-evaluate-aime24.yaml  # R1's AIME protocol
python evaluate.py --help
"""

import sys

from deepzero.distributed import exit_process
from deepzero.rollout.jobs import main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:], "evaluate"))
