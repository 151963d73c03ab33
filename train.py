"""Train a DeepSeek-family model with DeepSpeed ZeRO.

deepspeed --num_gpus=3 train.py --deepspeed_config ds_configs/zero2.json
python train.py --help
"""

from deepzero.distributed import exit_process
from deepzero.trainer import main

if __name__ == "__main__":
    exit_process(main())
