"""Every causal LM the installed transformers builds, small: for a sweep of exactness tests over all of them.

A plain module, imported by name (`from causal_lms import build_small`), like helpers.py. `causal_lm_types()` lists
the model types of transformers' causal-LM auto mapping; `build_small(model_type)` builds one from a shrunk config
(SMALL's sizes, then OVERRIDES) with random weights, no hub: in float64 unless FLOAT32_ONLY says why not, in train
mode, without dropout or a cache; or raises CannotBuildSmall with the reason that NOT_BUILDABLE gives. Token ids
3..VOCAB_SIZE-1 are valid inputs to every model; `supports_sdpa(model)` tells whether a test may switch it to sdpa.
All of them build in about 5 s on 2 cores."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB_SIZE = 128
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN = 64, 4, 2, 16, 2, 128

# the size of every model, by the standard names (a config's attribute_map translates them); a name is set only
# where the config has it. Sliding windows and attention chunks keep their defaults, longer than a test's rows: one
# shorter leaves a padding query nothing to attend to, and eager attention, whose softmax runs in float32, turns
# float64's finfo.min mask into -inf there, so NaN (seen on Mistral with a window of 16).
SMALL = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    intermediate_size=FFN,
    ffn_dim=FFN,
    max_position_embeddings=128,
    pad_token_id=PAD_TOKEN_ID,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    # encoder-decoder families' decoders
    decoder_layers=LAYERS,
    encoder_layers=LAYERS,
    decoder_attention_heads=HEADS,
    encoder_attention_heads=HEADS,
    decoder_ffn_dim=FFN,
    encoder_ffn_dim=FFN,
    num_decoder_layers=LAYERS,
    num_encoder_layers=LAYERS,
    num_decoder_attention_heads=HEADS,
    num_encoder_attention_heads=HEADS,
    max_seq_len=128,
    # mixtures of experts
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_num_experts=4,
    moe_num_shared_experts=1,
    moe_topk=2,
    zero_expert_num=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    first_k_dense_replace=1,
    # multi-head latent attention
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    qk_head_dim=16,
    v_head_dim=16,
    rotary_dim=8,
    # state-space and convolution layers
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_ssm=2 * HIDDEN,
    mamba_chunk_size=16,
    mamba_dt_rank=8,
    state_size=8,
    conv_kernel=4,
    time_step_rank=8,
    ssm_state_size=8,
    mamba_num_heads=8,
    mamba_head_dim=16,
    # linear attention (gated delta nets and the like)
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_head_dim=16,
    linear_num_heads=HEADS,
    # sparse attention's indexers, low ranks, and the sizes of the odd family that names them its own way
    index_n_heads=2,
    index_head_dim=16,
    index_topk=16,  # below a 40-token row, so that the indexer selects
    o_lora_rank=16,
    hc_lowrank=16,
    adapter_rank=8,
    block_multiple_of=32,
    swa_head_dim=HEAD_DIM,
    swa_num_attention_heads=HEADS,
    swa_num_key_value_heads=KV_HEADS,
    dim_head=HEAD_DIM,
    dff=FFN,
    d_inner=FFN,
    dim_ff=FFN,
    ffn_hidden_size=FFN,
    feed_forward_size=FFN,
    intermediate_size_mlp=FFN,
    dense_intermediate_size=FFN,
    shared_intermediate_size=32,
    shared_experts_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    unpadded_vocab_size=VOCAB_SIZE,
    vocab_size_per_layer_input=VOCAB_SIZE,
    hidden_size_per_layer_input=8,
    input_embedding_size=32,
    output_embedding_size=64,
    pronunciation_embed_dim=16,
    shape_embed_dim=16,
    pronunciation_vocab_size=32,
    shape_vocab_size=32,
)


# the types whose training forward needs the padded length to be a multiple of this
PAD_TO_MULTIPLE_OF = {"reformer": 8}  # its chunked attention's chunk length

# -- per-type overrides: config keyword arguments that SMALL's names do not reach ---------------------------------
OVERRIDES: dict[str, dict] = {
    "bamba": dict(attn_layer_indices=[1]),  # default: mamba layers only
    "blt": dict(
        encoder_hash_byte_group_vocab=64,
        encoder_config=dict(hidden_size_global=HIDDEN),
        decoder_config=dict(hidden_size_global=HIDDEN),
    ),
    "cohere_compass_text": dict(  # its rope_parameters are per layer type; its axial rotary splits head_dim / 2
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}
        }
    ),
    # 5.24's default attn_config has no rope_theta, and its clip_qkv=None fails the attention's clamp
    "dbrx": dict(attn_config=dict(kv_n_heads=KV_HEADS, rope_theta=1e4, clip_qkv=8.0)),
    "dory": dict(
        num_hidden_layers=3,
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "dots3_note_text": dict(  # its sliding-window layers' latent-attention sizes come apart, as swa_*
        head_dim=HEAD_DIM,
        swa_num_attention_heads=HEADS,
        swa_num_key_value_heads=HEADS,
        swa_q_lora_rank=32,
        swa_kv_lora_rank=16,
        swa_head_dim=HEAD_DIM,
        swa_qk_nope_head_dim=8,
        swa_v_head_dim=HEAD_DIM,
    ),
    "gemma3n_text": dict(num_kv_shared_layers=2, laurel_rank=8),
    "gemma4_text": dict(global_head_dim=32),
    "gemma4_unified_text": dict(global_head_dim=32),
    "got_ocr2": dict(
        vision_config=dict(
            image_size=64, mlp_dim=FFN, output_channels=32, global_attn_indexes=[1], window_size=2
        )
    ),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"]
    ),  # default: mamba layers only
    "inkling2_loop_text": dict(  # full and sliding layers, inside and outside the loop
        num_hidden_layers=4,
        layer_types=["hybrid", "hybrid", "hybrid_sliding", "hybrid_sliding"],
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=3,
        loop_num_passes=2,
        loop_gate_rank=8,
    ),
    # mamba and attention layers, dense and expert MLPs, in the combinations Jamba has
    "jamba": dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=2),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # num_heads * head_dim = expand * hidden_size; chunks shorter than a row
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, chunk_size=16),
    "qwen4_exp_text": dict(  # its QSA indexer has no defaults; its n-gram tables default to 20M rows
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=16,
        indexer_compress_ratio=4,
        ngram_vocab_size_base=256,
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=1,
        heads_per_ngram=2,
    ),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "reformer": dict(  # a decoder, without axial position embeddings (they fix the length)
        is_decoder=True,
        attn_layers=["local", "lsh"],
        axial_pos_embds=False,
        local_attn_chunk_length=PAD_TO_MULTIPLE_OF["reformer"],
        lsh_attn_chunk_length=PAD_TO_MULTIPLE_OF["reformer"],
        num_buckets=4,
        hash_seed=0,
    ),
    # two hybrid layers: they share one attention block, which a single one cannot tie
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    # it routes to one expert only
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=32),
}
# the composite configs whose mapped model class is built from one of their sub-configs
OVERRIDES["qwen4_exp"] = dict(text_config=OVERRIDES["qwen4_exp_text"])
OVERRIDES["gemma4"] = dict(text_config=OVERRIDES["gemma4_text"])
OVERRIDES["gemma4_unified"] = dict(text_config=OVERRIDES["gemma4_unified_text"])
OVERRIDES["phi4_multimodal"] = dict(
    audio_config=dict(
        num_blocks=1, ext_pw_out_channel=HIDDEN, depthwise_separable_out_channel=HIDDEN, nemo_conv_channels=32
    )
)
OVERRIDES["dots3_note"] = dict(
    text_config=OVERRIDES["dots3_note_text"],
    vision_config=dict(adapter_in_dim=HIDDEN, adapter_out_dim=HIDDEN),
    audio_config=dict(adapter_input_size=HIDDEN, adapter_out_dim=HIDDEN),
)

NOT_BUILDABLE: dict[str, str] = {
    "gemma3n": "its vision tower is a TimmWrapperModel, which needs the timm library (not a test dependency)",
    "gemma4_assistant": "a drafting head: its forward needs the target model's inputs_embeds and shared_kv_states",
    "gemma4_unified_assistant": "a drafting head: its forward needs the target model's inputs_embeds and "
    "shared_kv_states",
    "git": "needs pixel_values: its loss skips the image tokens' positions even when no image is given",
    "musicgen": "an audio-codebook decoder: its labels are [batch, seq, num_codebooks], which a text batch is not",
    "musicgen_melody": "an audio-codebook decoder: its labels are [batch, seq, num_codebooks], which a text batch "
    "is not",
}

# types whose forward does not run in float64 on the CPU
FLOAT32_ONLY: dict[str, str] = {
    "blt": "its eager softmax runs in float32, where float64's finfo.min mask is -inf: its patch cross-attention's "
    "fully masked rows give NaN",
    "prophetnet": "its padding mask is (1.0 - attention_mask) * finfo(float64).min in float32: 0 * -inf = NaN",
    "xglm": "its attention masks with torch.full((), finfo(float64).min), a float32 scalar that overflows",
}


class CannotBuildSmall(Exception):
    """This model type cannot be built small, or cannot train on the CPU; the message says why."""


def causal_lm_types() -> list[str]:
    """The model types of the installed transformers' causal-LM auto mapping, one per (config, model) class pair:
    of two types that share a pair (gpt2, gpt-sw3), the config's own."""
    by_pair: dict[tuple[str, str], str] = {}
    for model_type, model_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config_class = CONFIG_MAPPING[model_type]
        pair = (config_class.__name__, model_name)
        if pair not in by_pair or config_class.model_type == model_type:
            by_pair[pair] = model_type
    kept = set(by_pair.values())
    return [model_type for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if model_type in kept]


def model_dtype(model_type: str) -> torch.dtype:
    return torch.float32 if model_type in FLOAT32_ONLY else torch.float64


def small_config(model_type: str):
    """The config of `model_type`, shrunk."""
    config_class = CONFIG_MAPPING[model_type]
    return config_class(**_small_kwargs(config_class, OVERRIDES.get(model_type, {})))


def _defaults(config_class) -> dict:
    """A config's default attributes (sub-configs as dictionaries), as its constructor takes them."""
    config = config_class()
    return {
        name: value.to_dict() if isinstance(value, PreTrainedConfig) else value
        for name, value in vars(config).items()
        if not name.startswith("_")
    }


def _small_kwargs(config_class, overrides: dict) -> dict:
    defaults = _defaults(config_class)
    attribute_map = getattr(config_class, "attribute_map", {})
    kwargs = {}
    for name, value in SMALL.items():
        field = attribute_map.get(name, name)
        if field in defaults:
            kwargs[field] = value
    if (
        "kv_lora_rank" in defaults
    ):  # multi-head latent attention: a key and value per head, rotary part as head_dim
        kwargs[attribute_map.get("num_key_value_heads", "num_key_value_heads")] = HEADS
        if attribute_map.get("head_dim", "head_dim") in defaults:
            kwargs[attribute_map.get("head_dim", "head_dim")] = SMALL["qk_rope_head_dim"]
    for (
        field,
        value,
    ) in defaults.items():  # no dropout and no router noise: a training forward is deterministic
        if ("drop" in field or "jitter" in field) and isinstance(value, float):
            kwargs[field] = 0.0
    kwargs.update(_shrunk_layer_lists(defaults, attribute_map))
    for name, sub_class in getattr(config_class, "sub_configs", {}).items():
        if isinstance(defaults.get(name), dict):
            if sub_class.__name__ == "AutoConfig":
                sub_class = CONFIG_MAPPING[defaults[name]["model_type"]]
            kwargs[name] = _small_kwargs(sub_class, overrides.get(name, {}))
    kwargs.update(
        {name: value for name, value in overrides.items() if not isinstance(kwargs.get(name), dict)}
    )
    return kwargs


# lists of layer indices (the layers that have some feature); the other per-layer lists have one entry a layer
INDEX_LISTS = (
    "mlp_only_layers",
    "moe_layers",
    "full_attn_idxs",
    "hybrid_layer_ids",
    "cross_attention_layers",
    "attn_layer_indices",
)


def _shrunk_layer_lists(defaults: dict, attribute_map: dict) -> dict:
    """Per-layer lists (`layer_types` and the like) cut to one layer of each kind, and the layer count to match."""
    layers_field = attribute_map.get("num_hidden_layers", "num_hidden_layers")
    count = defaults.get(layers_field)
    if not isinstance(count, int) or count < 2:
        return {}
    per_layer = {
        f: v for f, v in defaults.items() if f not in INDEX_LISTS and isinstance(v, list) and len(v) == count
    }
    indexed = {f: set(v) for f, v in defaults.items() if f in INDEX_LISTS and isinstance(v, list)}
    if not per_layer and not indexed:
        return {}
    kinds = [
        tuple(str(v[i]) for v in per_layer.values()) + tuple(i in v for v in indexed.values())
        for i in range(count)
    ]
    keep = [i for i in range(count) if kinds[i] not in kinds[:i]]
    if len(keep) < LAYERS:
        keep = sorted(set(keep) | set(range(LAYERS)))
    shrunk = {f: [SMALL[f] if f in SMALL else v[i] for i in keep] for f, v in per_layer.items()}
    shrunk.update({f: [new for new, old in enumerate(keep) if old in v] for f, v in indexed.items()})
    shrunk[layers_field] = len(keep)
    return shrunk


def build_small(model_type: str, seed: int = 0) -> torch.nn.Module:
    """`model_type`'s causal LM, small, with random weights: seeded, in train mode, without a cache."""
    if model_type in NOT_BUILDABLE:
        raise CannotBuildSmall(NOT_BUILDABLE[model_type])
    config = small_config(model_type)
    config.use_cache = False
    dtype = model_dtype(model_type)
    torch.manual_seed(seed)
    # eager experts: the default, grouped_mm, has no float64 kernel on the CPU
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")
    if model_type == "xlnet":
        model.to(dtype)  # it creates its attention's parameters in float32 whatever the default dtype
    if model_type == "xmod":
        model.set_default_language("en_XX")
    model.config.use_cache = False
    return model.train()


def supports_sdpa(model) -> bool:
    """Whether `model`'s class declares sdpa support (`_supports_sdpa`), so that a test may set
    `config._attn_implementation = "sdpa"`. The others (every model runs eager) ignore that setting, refuse it, or
    quietly compute something else: MPT reads sdpa's keep-mask as a drop-mask, GPT-OSS's sinks (`s_aux`) never reach
    torch's sdpa, and about twenty more give other logits than under eager."""
    return bool(getattr(model, "_supports_sdpa", False))
