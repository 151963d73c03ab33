"""Prepare training data: ``python data/prepare.py --help`` (same as ``python -m deepzero.data.prepare``).

python data/prepare.py                       # stdlib corpus, local BPE tokenizer -> artifacts/data/stdlib
python data/prepare.py --input chats.jsonl --tokenizer artifacts/data/stdlib/tokenizer --out artifacts/data/sft
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepzero.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
