"""Every decoder architecture we claim, through the real KVManager: exact
against the model's own eager forward and generate, or refused up front.

Tiny seeded configs with weights at ``initializer_range=0.2``, so attention
is far from uniform and an integration that mixed up rows, positions, windows
or chunks could not pass by accident. Windows and chunks are a few tokens,
shorter than the sequences, so they bite.
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers")

from test_hf import _check_stream, _prompt  # noqa: E402
from test_hf_manager import ManagedRunner  # noqa: E402

from mstar.engine.resources.kv.cache import KVCache  # noqa: E402
from mstar.engine.resources.kv.manager import KVManager  # noqa: E402
from mstar.engine.resources.step import KVStep, Segment  # noqa: E402
from mstar.models.hf import forward_step, register, supports  # noqa: E402

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    # GPT-2 style names
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
    "n_inner": 96,
    # mixture of experts
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
}
WINDOW = {"sliding_window": 4}
ALTERNATING = {"layer_types": ["sliding_attention", "full_attention"], **WINDOW}
# Multi-head latent attention: K 16 wide (8 + 8 rotary), V 12.
MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "head_dim": 8,
    "v_head_dim": 12,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_key_value_heads": 4,
}

# name: (config class, its settings beyond COMMON)
SUPPORTED = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", WINDOW),
    "mixtral": ("MixtralConfig", WINDOW),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_moe": ("Qwen2MoeConfig", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {**ALTERNATING, "attn_logit_softcapping": 2.0}),
    "gemma3_text": ("Gemma3TextConfig", ALTERNATING),
    "phi3": ("Phi3Config", {}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", ALTERNATING),
    "granite": ("GraniteConfig", {}),
    "starcoder2": ("Starcoder2Config", WINDOW),
    "cohere": ("CohereConfig", {}),
    "cohere2": ("Cohere2Config", ALTERNATING),
    "glm4": ("Glm4Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "gptj": ("GPTJConfig", {"rotary_dim": 8}),
    "gpt2": ("GPT2Config", {}),
    "gpt_bigcode": ("GPTBigCodeConfig", {}),
    "opt": ("OPTConfig", {"ffn_dim": 96, "word_embed_proj_dim": 64}),
    "smollm3": ("SmolLM3Config", {}),
    "llama4_text": (
        "Llama4TextConfig",
        {
            "attention_chunk_size": 4,
            "no_rope_layers": [1, 0],
            "intermediate_size_mlp": 96,
            "interleave_moe_layer_step": 2,
        },
    ),
    "gpt_oss": ("GptOssConfig", {**ALTERNATING, "intermediate_size": 32}),
    "stablelm": ("StableLmConfig", {}),
    "phi": ("PhiConfig", {}),
    "exaone4": ("Exaone4Config", ALTERNATING),
    "helium": ("HeliumConfig", {}),
    "seed_oss": ("SeedOssConfig", {}),
    "ernie4_5": ("Ernie4_5Config", {}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {}),
    "glm4_moe": ("Glm4MoeConfig", {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "olmoe": ("OlmoeConfig", {}),
    "granitemoe": ("GraniteMoeConfig", {}),
    "vaultgemma": ("VaultGemmaConfig", ALTERNATING),
    "ministral": ("MinistralConfig", ALTERNATING),
    "codegen": ("CodeGenConfig", {"rotary_dim": 8}),
    "jetmoe": ("JetMoeConfig", {}),
    "biogpt": ("BioGptConfig", {}),
    "minimax_m2": ("MiniMaxM2Config", {}),
    "afmoe": ("AfmoeConfig", {}),
    "cohere2_moe": ("Cohere2MoeConfig", ALTERNATING),
    "nemotron": ("NemotronConfig", {}),
    "deepseek_v3": ("DeepseekV3Config", MLA),
    "deepseek_v2": ("DeepseekV2Config", MLA),
}

# name: (config class, its settings, what the refusal names)
REFUSED = {
    "diffllama": ("DiffLlamaConfig", {}, "more than once in layer"),
    "minimax": (
        "MiniMaxConfig",
        {"layer_types": ["linear_attention", "full_attention"]},
        "linear_attention",
    ),
    "zaya": (
        "ZayaConfig",
        {"num_experts_per_tok": 1},
        "linear|no attention in layer|layers of type",
    ),
    "qwen3_next": ("Qwen3NextConfig", {}, "linear_attention"),
    "jamba": (
        "JambaConfig",
        {"attn_layer_period": 2, "attn_layer_offset": 1},
        "linear_attention",
    ),
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}, r"\['conv'\]"),
    "hrm_text": ("HrmTextConfig", {}, "more than once in layer"),
    "qwen3_5_text": ("Qwen3_5TextConfig", {}, "linear_attention"),
    "falcon_h1": ("FalconH1Config", {}, r"\['hybrid'\]"),
    "deepseek_v4": ("DeepseekV4Config", {}, "heavily_compressed_attention"),
    "doge": ("DogeConfig", {}, "a mask of its own"),
    "xglm": ("XGLMConfig", {}, "does not route attention"),
    "bloom": ("BloomConfig", {}, "ALiBi|does not route attention"),
    "mpt": ("MptConfig", {"d_model": 64, "n_heads": 4, "n_layers": 2}, "ALiBi|does not route"),
    "gpt_neo": (
        "GPTNeoConfig",
        {"num_layers": 2, "num_heads": 4, "attention_types": [[["global", "local"], 1]]},
        "does not route attention",
    ),
}


# Falcon routes attention through AttentionInterface from transformers 5.25;
# before, it is refused for not doing so.
if Version(transformers.__version__) >= Version("5.25"):
    SUPPORTED["falcon"] = ("FalconConfig", {"alibi": False})
    SUPPORTED["falcon_new_decoder"] = (
        "FalconConfig",
        {"alibi": False, "new_decoder_architecture": True, "num_kv_heads": 2},
    )
    REFUSED["falcon_alibi"] = ("FalconConfig", {"alibi": True}, "ALiBi")
else:
    REFUSED["falcon"] = ("FalconConfig", {"alibi": False}, "does not route attention")


def _config(class_name: str, settings: dict):
    """COMMON's settings the config class takes, then ``settings``."""
    cls = getattr(transformers, class_name)
    takes = set(inspect.signature(cls.__init__).parameters) | set(vars(cls()).keys())
    return cls(**{**{k: v for k, v in COMMON.items() if k in takes}, **settings})


def _pair(class_name: str, settings: dict):
    """A seeded model (the oracle: eager attention, no EOS) and its twin on
    the plan."""
    config = _config(class_name, settings)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.set_attn_implementation("eager")
    reference.generation_config.eos_token_id = None
    paged = copy.deepcopy(reference)
    paged.set_attn_implementation(register())
    return reference, paged


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def pair(request):
    class_name, settings = SUPPORTED[request.param]
    reference, paged = _pair(class_name, settings)
    assert supports(paged) is None, supports(paged)
    return reference, paged


def test_chunked_prefill_beside_decode(pair):
    """One prompt in three chunks beside another's decode rows, then decode
    steps crossing pages; every step's logits against one full forward, the
    greedy tokens against generate."""
    reference, paged = pair
    a, b = ("a", "main"), ("b", "main")
    prompt_a, prompt_b = _prompt(11, seed=5), _prompt(6, seed=6)
    run = ManagedRunner(paged, page_size=4)
    run.step({a: prompt_a[:5], b: prompt_b})
    run.step({b: [run.next_token(b)], a: prompt_a[5:9]})
    run.step({a: prompt_a[9:], b: [run.next_token(b)]})
    for _ in range(3):
        run.decode([a, b])
    _check_stream(reference, run, a, len(prompt_a))
    _check_stream(reference, run, b, len(prompt_b))


def test_forked_branches_match_their_own_forward(pair):
    """A prompt forked into two samples (full pages shared, the tail page
    copied), each continuing from a different token: each branch's logits
    are its own sequence's."""
    reference, paged = pair
    main, s0, s1 = ("p", "main"), ("p", "s0"), ("p", "s1")
    prompt = _prompt(10, seed=7)
    run = ManagedRunner(paged, page_size=4)
    run.step({main: prompt})
    run.fork(main, ["s0", "s1"])
    first, second = run.logits[main][-1][-1].topk(2).indices.tolist()
    run.step({s0: [first], s1: [second]})
    run.mgr.release("p", "main")
    for _ in range(2):
        run.decode([s0, s1])
    for stream in (s0, s1):
        tokens = torch.tensor([run.tokens[stream]])
        with torch.no_grad():
            expected = reference(tokens, use_cache=False).logits[0]
        err = (torch.cat(run.logits[stream]) - expected).abs().max().item()
        assert err <= 1e-4, f"{stream}: max abs logit error {err}"


def _one_step(cache: KVCache):
    """A three-token prompt admitted and planned by the real manager."""
    mgr = KVManager(cache.num_pages, cache.page_size, cache=cache)
    step = KVStep((Segment("a", "main", 3),))
    mgr.admit(step)
    return mgr.plan(step)["main"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_before_anything_runs(name):
    """supports() names the reason; forward_step raises it before any
    attention writes the cache."""
    class_name, settings, reason = REFUSED[name]
    _, paged = _pair(class_name, settings)
    verdict = supports(paged)
    assert verdict is not None and re.search(reason, verdict), verdict
    cache = KVCache(2, 8, 4, 2, 16)
    with pytest.raises(ValueError, match="expected a model the paged path serves exactly"):
        forward_step(paged, torch.tensor([1, 2, 3]), _one_step(cache), cache)
    assert not cache.layer(0).any()


def test_a_layer_mixing_tokens_without_attention_is_refused():
    """A decoder layer whose token mixer is not attention (here Llama's layer
    1 replaced by a running sum over the sequence, as an SSM would mix)
    would see the packed step as one sequence: the probe finds the layer
    without an attention call."""
    _, paged = _pair(*SUPPORTED["llama"])

    def running_sum(hidden_states, **kwargs):
        return hidden_states.cumsum(dim=1), None

    paged.model.layers[1].self_attn.forward = running_sum
    assert "no attention in layer(s) [1] of 2" in supports(paged)


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"attention_chunk_size": 4}, "attention_chunk_size=4 without layer_types"),
        (
            {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
            r"types layer\(s\) \[0\] sliding_attention but passes .* no sliding_window",
        ),
    ],
)
def test_a_window_or_chunk_only_the_mask_would_apply_is_refused(settings, reason):
    """Llama's attention takes no window or chunk: a config asking for one
    would be honoured only by the mask the plan replaces."""
    _, paged = _pair("LlamaConfig", settings)
    assert re.search(reason, supports(paged)), supports(paged)
