"""deepzero: DeepSpeed ZeRO recipes for DeepSeek-family language models on a few consumer GPUs."""

__version__ = "0.1.0"
