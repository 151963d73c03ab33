"""A preset that names a checkpoint is a short name for it: when its weights load, the checkpoint's own config.json
(RoPE scaling, special token ids) builds the model, never the preset's restated architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from deepzero import modeling
from deepzero.presets import PRESETS, ModelPreset, get_preset

LINEAR = {"rope_type": "linear", "factor": 4.0}
"""deepseek-coder-1.3b-base's config.json: linear RoPE scaling × 4 (16K context), bos 32013, eos 32014."""
YARN = {
    "type": "yarn",
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
}
"""DeepSeek-V2-Lite's config.json: YaRN, 4K → 160K."""
SMALL_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=32256)


def checkpoint(folder: Path, model_type: str, arch: dict, **published: object) -> Path:
    """A local 'published checkpoint': random weights saved with ``published`` in its config.json."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**arch, **published})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def preset_for(monkeypatch: pytest.MonkeyPatch, name: str, model_type: str, arch: dict, folder: Path) -> str:
    """A preset naming ``folder`` as its hub id, whose restated arch lacks the checkpoint's RoPE scaling and ids."""
    monkeypatch.setitem(PRESETS, name, ModelPreset(name, model_type, arch, hub_id=str(folder)))
    return name


def test_a_preset_naming_a_checkpoint_trains_with_its_own_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = dict(rope_scaling=LINEAR, rope_theta=100000.0, max_position_embeddings=16384)
    folder = checkpoint(tmp_path / "coder", "llama", SMALL_LLAMA, bos_token_id=32013, eos_token_id=32014, **published)
    name = preset_for(monkeypatch, "tiny-coder", "llama", {**SMALL_LLAMA, "rope_theta": 100000.0}, folder)
    source = modeling.resolve_model(name)
    config = modeling.load_config(source)
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 4.0
    assert (config.bos_token_id, config.eos_token_id, config.max_position_embeddings) == (32013, 32014, 16384)
    model = modeling.build_model(source, get_preset(name).config())  # the preset's config must not win
    assert model.config.rope_parameters["factor"] == 4.0 and model.config.bos_token_id == 32013
    unscaled = AutoModelForCausalLM.from_config(get_preset(name).config()).model.rotary_emb.inv_freq
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, unscaled / 4.0)  # positions really are scaled


def test_yarn_scaling_of_a_deepseek_v2_checkpoint_reaches_the_rotary_embedding(tmp_path: Path) -> None:
    arch = {**get_preset("tiny-deepseek-v2").arch, "vocab_size": 512}
    folder = checkpoint(
        tmp_path / "v2", "deepseek_v2", arch, rope_scaling=YARN, rope_theta=10000, max_position_embeddings=163840
    )
    model = modeling.build_model(
        modeling.resolve_model(str(folder)), modeling.load_config(modeling.resolve_model(str(folder)))
    )
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "yarn"
    assert {k: model.config.rope_parameters[k] for k in YARN if k != "type"} == {
        k: v for k, v in YARN.items() if k != "type"
    }
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v2", **arch)).model
    assert not torch.equal(rotary.inv_freq, plain.rotary_emb.inv_freq)  # YaRN's interpolated frequencies
    # mscale == mscale_all_dim: the cos/sin factor stays 1 and DeepSeek's attention scales its softmax by mscale²
    assert rotary.attention_scaling == pytest.approx(1.0)
    scaled, unscaled = model.model.layers[0].self_attn.scaling, plain.layers[0].self_attn.scaling
    assert scaled > unscaled * 1.5


def test_offline_checks_fall_back_to_the_presets_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before weights load, a hub preset without network or cache is checked with its restated config."""

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(modeling.AutoConfig, "from_pretrained", offline)
    config = modeling.load_config(modeling.resolve_model("deepseek-coder-1.3b"))
    assert config.num_hidden_layers == get_preset("deepseek-coder-1.3b").config().num_hidden_layers
