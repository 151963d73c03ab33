"""Write a tokenizer folder: ``python data/tokenizer.py --help`` (same as ``python -m deepzero.data.tokenizer``).

python data/tokenizer.py deepseek --out artifacts/tokenizers/deepseek   # DeepSeek's tokenizer + chat template
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepzero.data.tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
