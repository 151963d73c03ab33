"""The losses the engines train with, as plug-ins of the model: the causal-LM loss computed over the LM head in
token tiles (``tiled``), so that no engine ever holds the [tokens × vocab] logits whole."""

from deepzero.tiled_loss import TiledLoss, install_tiled_loss, tiled_cross_entropy

__all__ = ["TiledLoss", "install_tiled_loss", "tiled_cross_entropy"]
