"""Train a DeepSeek-family model with DeepSpeed ZeRO.

deepspeed --num_gpus=3 train.py --deepspeed_config ds_configs/zero2.json
python train.py --help
"""

import sys

from deepzero.trainer import main

if __name__ == "__main__":
    sys.exit(main())
