"""Presets naming a real checkpoint are built from its published config.json (deepzero/published/), key by key.

Transformers 5 renames one thing on the way: ``rope_scaling`` + ``rope_theta`` become ``rope_parameters``
(``{**rope_scaling, "rope_theta": ..., "rope_type": rope_scaling["type"]}``); every other key keeps its name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from deepzero import modeling
from deepzero.presets import (
    LOADER_KEYS,
    PRESETS,
    PUBLISHED_DIR,
    ModelPreset,
    partial_path,
    published_config,
    published_path,
)

VERIFIED = [p for p in PRESETS.values() if p.verified]
UNVERIFIED = [p for p in PRESETS.values() if p.hub_id and not p.verified]
PARTLY = [p for p in UNVERIFIED if partial_path(p.hub_id).exists()]
ROUTING_KEYS = (
    "scoring_func",
    "topk_method",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "aux_loss_alpha",
    "seq_aux",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_layer_freq",
    "ep_size",
)
PRINTER_KEYS = ("_name_or_path", "transformers_version")
"""Keys a config gets from where and with what it was loaded, not from the checkpoint."""


def expected_rope(published: dict[str, Any]) -> dict[str, Any]:
    """What Transformers 5 makes of a published rope_scaling + rope_theta: one rope_parameters dict."""
    scaling = published.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return {**scaling, "rope_theta": published["rope_theta"], "rope_type": rope_type}


def mismatches(config: PretrainedConfig, published: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every architecture key of the published file whose value the built config does not carry."""
    out = {}
    for key, want in published.items():
        if key in LOADER_KEYS or key in ("rope_scaling", "rope_theta"):
            continue
        got = getattr(config, key, "<missing>")
        if got != want:
            out[key] = (got, want)
    if getattr(config, "rope_parameters", None) != expected_rope(published):
        out["rope_parameters"] = (getattr(config, "rope_parameters", None), expected_rope(published))
    return out


def test_every_published_file_has_a_verified_preset_that_reads_it() -> None:
    files = {path.name for path in PUBLISHED_DIR.glob("*.json") if not path.name.endswith(".partial.json")}
    assert files == {published_path(p.hub_id).name for p in VERIFIED}
    assert len(VERIFIED) >= 10
    for preset in VERIFIED:
        published = published_config(preset.hub_id)
        assert preset.model_type == published["model_type"]
        assert preset.arch == {k: v for k, v in published.items() if k not in LOADER_KEYS}  # no restated dict


@pytest.mark.parametrize("preset", [p for p in PRESETS.values() if "rope_scaling" in p.arch], ids=lambda p: p.name)
def test_building_a_config_leaves_the_preset_unchanged(preset: ModelPreset) -> None:
    """Transformers writes rope_theta and rope_type into the rope_scaling dict it is given; the preset's must not
    change (it did: a second config and the key-by-key check then saw the first one's additions)."""
    before = copy.deepcopy(preset.arch)
    assert preset.config().rope_parameters == preset.config().rope_parameters
    assert preset.arch == before


@pytest.mark.parametrize("preset", VERIFIED, ids=lambda p: p.name)
def test_the_preset_config_equals_the_published_file_key_by_key(preset: ModelPreset) -> None:
    published = published_config(preset.hub_id)
    config = preset.config()
    assert mismatches(config, published) == {}
    for key in ("max_position_embeddings", "vocab_size", "tie_word_embeddings", "rope_theta"):
        assert key in published, key  # the keys that matter are really compared, not skipped
    if "n_routed_experts" in published:
        assert [k for k in ROUTING_KEYS if k not in published] == []


def test_the_comparison_catches_a_wrong_rope_or_routing_key() -> None:
    """The key-by-key check fails on the differences issue 13 found (rope scaling, routing, ids)."""
    preset = PRESETS["deepseek-v2-lite-chat"]
    published = published_config(preset.hub_id)
    no_yarn = {k: v for k, v in preset.arch.items() if k != "rope_scaling"}
    assert set(mismatches(AutoConfig.for_model(preset.model_type, **no_yarn), published)) == {"rope_parameters"}
    wrong = preset.config(topk_method="group_limited_greedy", seq_aux=False, eos_token_id=2)
    assert set(mismatches(wrong, published)) == {"topk_method", "seq_aux", "eos_token_id"}


@pytest.mark.parametrize("preset", VERIFIED, ids=lambda p: p.name)
def test_loading_the_published_file_builds_the_presets_config(preset: ModelPreset, tmp_path: Path) -> None:
    """A folder holding the published config.json (what from_pretrained reads) gives the same config as the
    preset offline: plan, placement and the checks before weights load size the model that trains."""
    (tmp_path / "config.json").write_text(json.dumps(published_config(preset.hub_id)))
    loaded = AutoConfig.from_pretrained(tmp_path).to_dict()
    offline = preset.config().to_dict()
    for key in (*PRINTER_KEYS, "architectures", "auto_map", "dtype"):
        loaded.pop(key, None)
        offline.pop(key, None)
    assert offline == loaded


@pytest.mark.parametrize("preset", VERIFIED, ids=lambda p: p.name)
def test_planning_by_hub_id_uses_the_published_config(preset: ModelPreset) -> None:
    name, config = modeling.planning_config(preset.hub_id)
    assert name == preset.name
    assert mismatches(config, published_config(preset.hub_id)) == {}


def test_v2_lite_chat_rotary_embedding_is_yarn() -> None:
    """The published YaRN scaling reaches the rotary frequencies of the model the preset builds."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding

    config = PRESETS["deepseek-v2-lite-chat"].config()
    scaled = DeepseekV2RotaryEmbedding(config).inv_freq
    plain = DeepseekV2RotaryEmbedding(PRESETS["deepseek-v2-lite-chat"].config(rope_scaling=None)).inv_freq
    assert torch.allclose(scaled[:4], plain[:4])  # high frequencies kept
    assert torch.allclose(scaled[-4:], plain[-4:] / 40, rtol=1e-4)  # low frequencies interpolated by the factor


def test_presets_without_a_published_config_say_so() -> None:
    for preset in UNVERIFIED:
        assert not published_path(preset.hub_id).exists()
        said = "config partly verified" if preset in PARTLY else "config not verified"
        assert said in preset.about, preset.name
    assert (PUBLISHED_DIR / "SOURCES.md").is_file()
    sources = (PUBLISHED_DIR / "SOURCES.md").read_text()
    for preset in VERIFIED:
        assert published_path(preset.hub_id).name in sources, preset.name
    for preset in PARTLY:
        assert partial_path(preset.hub_id).name in sources, preset.name


@pytest.mark.parametrize("preset", PARTLY, ids=lambda p: p.name)
def test_a_partly_found_config_keeps_every_key_that_was_found(preset: ModelPreset) -> None:
    """The keys the stored copy shows are the preset's, key by key; the rest come from a published config of the
    same architecture (DeepSeek-V2-Lite-Chat), whose YaRN RoPE and routing keys the preset then carries."""
    head = json.loads(partial_path(preset.hub_id).read_text())
    config = preset.config()
    found = {k: v for k, v in head.items() if k not in LOADER_KEYS}
    assert len(found) >= 25 and "n_routed_experts" in found and "qk_rope_head_dim" in found
    assert {k: getattr(config, k, "<missing>") for k in found} == found
    chat = PRESETS["deepseek-v2-lite-chat"].config()
    assert config.rope_parameters == chat.rope_parameters and config.rope_parameters["rope_type"] == "yarn"
    assert [k for k in ROUTING_KEYS if getattr(config, k) != getattr(chat, k)] == []


def test_r1_distill_llama_rotary_embedding_is_llama3() -> None:
    """The published llama3 RoPE scaling (factor 8, original 8192) reaches the rotary frequencies."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    preset = PRESETS["deepseek-r1-distill-llama-8b"]
    scaled = LlamaRotaryEmbedding(preset.config()).inv_freq
    plain = LlamaRotaryEmbedding(preset.config(rope_scaling=None)).inv_freq
    assert torch.allclose(scaled[:8], plain[:8])  # wavelengths under 8192/4 kept
    assert torch.allclose(scaled[-4:], plain[-4:] / 8)  # wavelengths over 8192 divided by the factor


def test_readme_fit_table_is_the_planners_output() -> None:
    """README's "which preset fits" table is pasted from `python -m deepzero.plan --fit-table` (its command is
    written above it) and has a row for every preset naming a checkpoint."""
    from deepzero.plan import fit_table

    table = fit_table(3, 24, 128, 2048)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "python -m deepzero.plan --fit-table --gpus 3 --gpu-mem 24 --cpu-mem 128 --seq-len 2048" in readme
    assert table in readme
    rows = {line.split("|")[1].strip() for line in table.splitlines()[2:]}
    assert rows == {p.name for p in PRESETS.values() if p.hub_id}
