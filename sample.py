"""Rejection sampling: k samples per prompt, scored; the kept ones as chat SFT data for prepare --format chat.

deepspeed --num_gpus=3 sample.py --model runs/grpo/hf --data artifacts/data/grpo_example --reward exact --out artifacts/rs/round1.jsonl
python sample.py --help
"""

import sys

from deepzero.distributed import exit_process
from deepzero.rollout.jobs import main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:], "sample"))
