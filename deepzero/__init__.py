"""deepzero: DeepSpeed ZeRO recipes for DeepSeek-family language models on a few consumer GPUs."""

import os
import sys

__version__ = "0.1.0"

# DeepSpeed JIT-builds its ops into torch's extensions folder, by default one for every environment of the user
# (~/.cache/torch_extensions): two checkouts with their own .venv would rebuild each other's ops on every other
# launch. Unless the user chose a folder, each environment builds into its own (deepzero/op_builds.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
