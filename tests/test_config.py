"""ModelConfig: presets, the release's config.json, and validation that names the bad field."""

from __future__ import annotations

import copy
import json

import pytest

from dsv41.accounting import compute
from dsv41.config import ConfigError, ModelConfig, from_dict, from_hf_config, load_config, preset_names
from dsv41.plan import engram_table_rows, layer_plan


def test_presets_load() -> None:
    assert {"v41-flash", "small", "tiny"} <= set(preset_names())
    for name in preset_names():
        c = load_config(name)
        assert isinstance(c, ModelConfig)
        assert from_dict(c.to_dict()) == c  # flat JSON round trip
        # the tables' row counts are the sums of their bucket primes
        assert c.engram_num_embeddings == engram_table_rows(c), name


def _visible(tokens: int, m: int) -> int:
    return tokens // m  # entries a query at the end of `tokens` may select


def _mechanism_limits(c: ModelConfig, tokens: int) -> None:
    """At `tokens`, the window, top-k and candidate pool must all be smaller than what they cut."""
    plans = layer_plan(c)
    assert c.window_size < tokens
    for p in plans:
        if p.ratio:
            assert c.index_topk < _visible(tokens, p.ratio), (p.layer_id, c.index_topk)
        if p.uses_candidates:
            assert c.candidate_topk_blocks * c.candidate_block_size < _visible(tokens, p.ratio)


def test_small_fits_one_gpu_and_exercises_sparsity() -> None:
    c = load_config("small")
    params = compute(c)["backbone_params"]
    assert 50e6 <= params <= 200e6, f"small has {params / 1e6:.1f}M backbone params"
    assert c.window_size <= c.max_seq_len // 8
    _mechanism_limits(c, c.max_seq_len)


@pytest.mark.parametrize("tokens", [256, 512])
def test_tiny_exercises_every_mechanism(tokens: int) -> None:
    c = load_config("tiny")
    assert tokens <= c.max_seq_len
    _mechanism_limits(c, tokens)
    modes = {p.mode for p in layer_plan(c)}
    assert modes == {"window", "full", "reindex", "reuse"}
    assert c.engram_layer_ids and c.hc_mult > 1 and c.candidate_source_layer >= 0
    assert c.n_routed_experts > c.n_activated_experts


# ---------------------------------------------------------------------- the release's config.json
def _hf_release() -> dict:
    """A config.json spelled with the release's real keys and the published values."""
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "moe_intermediate_size": 2304,
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20, "max_position_embeddings": 1048576, "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
        "compress_rope_theta": 160000, "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_n_heads": 32, "index_head_dim": 128,
        "index_topk": 512, "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048,
        "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
        "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    }
    vision = {
        "model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
        "num_attention_heads": 16,
        "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
        "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                "expert_dtype": "fp4"},
        "text_config": text, "vision_config": vision,
    }


def test_hf_config_equals_the_preset_field_by_field(tmp_path) -> None:
    preset = load_config("v41-flash").to_dict()
    from_hf = from_hf_config(_hf_release()).to_dict()
    diff = {k: (preset[k], from_hf[k]) for k in preset if preset[k] != from_hf[k]}
    assert diff == {}, diff
    # the same through a checkpoint directory on disk
    (tmp_path / "config.json").write_text(json.dumps(_hf_release()))
    assert load_config(tmp_path).to_dict() == preset


def test_hf_config_unknown_key_is_named() -> None:
    data = _hf_release()
    data["text_config"]["num_expert_groups"] = 8
    with pytest.raises(ConfigError, match=r"'text_config\.num_expert_groups'"):
        from_hf_config(data)


def test_hf_config_errors_name_the_flat_field() -> None:
    data = copy.deepcopy(_hf_release())
    data["text_config"]["o_groups"] = 7
    with pytest.raises(ConfigError, match="'o_groups'"):
        from_hf_config(data)


# ---------------------------------------------------------------------- validation
def _flash(**changes) -> dict:
    d = load_config("v41-flash").to_dict()
    d.update(changes)
    return d


ratios_decoder_bad = [0, 0] + [2] * 18 + [1] * 4 + [2] + [1] * 15 + [0, 0, 0]  # layer 24 (Reindex) at m=2

MISTAKES = {
    "unknown key": (dict(n_kv_heads=1), "n_kv_heads"),
    "kv source with ratio 0": (dict(kv_source_layers=[1, 2, 8, 14, 20],
                                    index_source_layers=[1, 2, 8, 14, 20, 24, 28, 32, 36]),
                               "kv_source_layers"),
    "reindex layer without a source of its ratio": (dict(compress_ratios=ratios_decoder_bad),
                                                    "compress_ratios"),
    "reuse layer without an earlier source": (dict(kv_source_layers=[8, 14, 20]), "kv_source_layers"),
    "non-positive size": (dict(dim=0), "dim"),
    "negative window": (dict(window_size=-128), "window_size"),
    "heads not divisible by o_groups": (dict(o_groups=6), "o_groups"),
    "kv source not an index source": (dict(index_source_layers=[2, 8, 20, 24, 28, 32, 36]),
                                      "index_source_layers"),
    "candidate source not an index source": (dict(candidate_source_layer=21), "candidate_source_layer"),
    "wrong number of ratios": (dict(compress_ratios=[1] * 39), "compress_ratios"),
    "ratios not a list": (dict(compress_ratios=2), "compress_ratios"),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_validation_names_the_field(case: str) -> None:
    changes, field_name = MISTAKES[case]
    with pytest.raises(ConfigError, match=f"'{field_name}'"):
        from_dict(_flash(**changes))


def test_replace_validates() -> None:
    c = load_config("tiny")
    assert c.replace(window_size=16).window_size == 16
    with pytest.raises(ConfigError, match="'n_heads'"):
        c.replace(n_heads=-4)
    with pytest.raises(ConfigError, match="'no_such_field'"):
        c.replace(no_such_field=1)
