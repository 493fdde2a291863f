"""The default mappings of SmoothQuant and AWQ: model facts, by model class (config.architectures[0]), as
llmcompressor 0.14's registries give them. Family.smoothing_mappings and Family.awq_mappings answer from here; a job
records the patterns it resolved, so that a change of these tables never changes a resumed job.

A SmoothQuant mapping is (balance patterns, smooth pattern); an AWQ mapping is (smooth pattern, balance patterns,
activation hook target). Patterns are compressed-tensors' (a name, or re:REGEX)."""

from elastic_oneshot.errors import UsageError

# Default mappings by architecture (the peer's SmoothQuant registry), as (balance patterns, smooth pattern).
_ATTENTION = (("re:.*q_proj", "re:.*k_proj", "re:.*v_proj"), "re:.*input_layernorm")
_MLP = (("re:.*gate_proj", "re:.*up_proj"), "re:.*post_attention_layernorm")
_SQ_DEFAULT = (_ATTENTION, _MLP)
# Mixtures smooth attention only: one scale over all experts unbalances them.
_SQ_MOE = ((("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"), "re:.*input_layernorm$"),)
_PARALLEL = (("re:.*self_attn\\.q_proj$", "re:.*self_attn\\.k_proj$", "re:.*self_attn\\.v_proj$"),
             "re:.*input_layernorm$")  # attention and MLP read one norm: both balanced
_SQ_MAPPINGS = {
    _SQ_DEFAULT: ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Glm4MoeForCausalLM",
                  "GraniteForCausalLM", "Llama4ForConditionalGeneration", "LlamaForCausalLM",
                  "Mistral3ForConditionalGeneration", "MistralForCausalLM", "NanbeigeForCausalLM", "Qwen2ForCausalLM",
                  "Qwen2_5OmniModel", "Qwen2_5OmniThinkerForConditionalGeneration",
                  "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "SeedOssForCausalLM"),
    (_ATTENTION,): ("MixtralForCausalLM", "Ernie4_5_MoeForCausalLM"),
    _SQ_MOE: ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    ((("re:.*query_key_value",), "re:.*input_layernorm"), (("re:.*dense_h_to_4h",), "re:.*post_attention_layernorm")):
        ("BloomForCausalLM", "ChatGLMForConditionalGeneration"),
    ((("re:.*qkv_proj",), "re:.*input_layernorm"), (("re:.*gate_up_proj",), "re:.*post_attention_layernorm")):
        ("Phi3ForCausalLM", "Phi3VForCausalLM"),
    ((("re:.*q(_a)?_proj$", "re:.*kv_a_proj_with_mqa"), "re:.*input_layernorm"),):
        ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM"),
    (((*_PARALLEL[0], "re:.*mlp\\.gate_proj$", "re:.*mlp\\.up_proj$"), _PARALLEL[1]),):
        ("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2VisionForConditionalGeneration"),
    (((*_PARALLEL[0], "re:.*gate_proj$", "re:.*up_proj$"), _PARALLEL[1]),): ("Cohere2MoeForCausalLM",),
    ((("re:.*self_attn\\.q_proj", "re:.*self_attn\\.k_proj", "re:.*self_attn\\.v_proj", "re:.*self_attn\\.gate_proj"),
      "re:.*input_layernorm"), (("re:.*mlp.*gate_proj", "re:.*mlp.*up_proj"), "re:.*pre_mlp_layernorm")):
        ("AfmoeForCausalLM",),
}
_SQ_BY_ARCHITECTURE = {arch: mappings for mappings, archs in _SQ_MAPPINGS.items() for arch in archs}
# Hybrid attention: the peer builds these from the layer types; here they must be given.
_SQ_NO_DEFAULT = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                  "Qwen3_5MoeForConditionalGeneration")


# Default mappings by architecture (the peer's AWQ registry), as (smooth, balance patterns, activation hook target).
_QKV = ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$")
_V_O = ("re:.*v_proj$", ("re:.*o_proj$",), None)
_UP_DOWN = ("re:.*up_proj$", ("re:.*down_proj$",), None)
_AWQ_DEFAULT = (("re:.*input_layernorm$", _QKV, None), _V_O,
                ("re:.*post_attention_layernorm$", ("re:.*gate_proj$", "re:.*up_proj$"), None), _UP_DOWN)
_AWQ_MOE = (("re:.*input_layernorm$", _QKV, None), _V_O, ("re:.*post_attention_layernorm$", (
    "re:.*mlp.gate$", "re:.*mlp.experts.*.gate_proj$", "re:.*mlp.experts.*.up_proj$"), None), _UP_DOWN)
_MLA = ("re:.*input_layernorm$", ("re:.*(q|q_a)_proj$", "re:.*kv_a_proj_with_mqa$"), None)
_MLA_NORMS = (("re:.*q_a_layernorm$", ("re:.*q_b_proj$",), None), ("re:.*kv_a_layernorm$", ("re:.*kv_b_proj$",), None))
_MLA_DENSE_FIRST = (_MLA, *_MLA_NORMS, ("re:.*post_attention_layernorm$", ("re:.*gate_proj$", "re:.*up_proj$"), None),
                    _UP_DOWN)
_COHERE_ATTENTION = ("re:.*self_attn.q_proj$", "re:.*self_attn.k_proj$", "re:.*self_attn.v_proj$")
_LM = r"re:.*language_model\.layers\.\d+\."
_AWQ_MAPPINGS = {
    _AWQ_DEFAULT: ("GraniteForCausalLM", "LlamaForCausalLM", "Mistral3ForConditionalGeneration", "MistralForCausalLM",
                   "NanbeigeForCausalLM", "Qwen2ForCausalLM", "Qwen2_5OmniModel",
                   "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen3ForCausalLM", "SeedOssForCausalLM",
                   "Ernie4_5_MoeForCausalLM"),
    _AWQ_MOE: ("Glm4MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    (("re:.*input_layernorm$", _QKV, None), _V_O, ("re:.*post_attention_layernorm$", (
        "re:.*feed_forward.router$", "re:.*feed_forward.*.gate_proj$", "re:.*feed_forward.*.up_proj$"), None),
     _UP_DOWN): ("Llama4ForConditionalGeneration",),
    (("re:.*input_layernorm$", ("re:.*qkv_proj$",), None), ("re:.*qkv_proj$", ("re:.*o_proj$",), None),
     ("re:.*post_attention_layernorm$", ("re:.*gate_up_proj$",), None),
     ("re:.*gate_up_proj$", ("re:.*down_proj$",), None)): ("Phi3ForCausalLM", "Phi3VForCausalLM"),
    (("re:.*input_layernorm$", _QKV, None), _V_O,
     ("re:.*pre_feedforward_layernorm$", ("re:.*gate_proj$", "re:.*up_proj$"), None), _UP_DOWN):
        ("Gemma2ForCausalLM",),
    (_V_O, ("re:.*pre_feedforward_layernorm$", ("re:.*gate_proj$", "re:.*up_proj$"), None), _UP_DOWN):
        ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    ((f"{_LM}input_layernorm$", tuple(f"{_LM}self_attn.{p}_proj$" for p in ("q", "k", "v", "gate")), None),
     (f"{_LM}self_attn.v_proj$", (f"{_LM}self_attn.o_proj$",), None),
     (f"{_LM}pre_feedforward_layernorm$", (f"{_LM}mlp.gate_proj$", f"{_LM}mlp.up_proj$"), None),
     (f"{_LM}mlp.up_proj$", (f"{_LM}mlp.down_proj$",), None)): ("MuseGlimmerForConditionalGeneration",),
    (("re:.*input_layernorm$", (*_COHERE_ATTENTION, "re:.*mlp.gate_proj$", "re:.*mlp.up_proj$"), None), _V_O,
     _UP_DOWN): ("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2VisionForConditionalGeneration"),
    (("re:.*input_layernorm$", (*_COHERE_ATTENTION, "re:.*gate_proj$", "re:.*up_proj$"), None), _V_O, _UP_DOWN):
        ("Cohere2MoeForCausalLM",),
    (_MLA, *_MLA_NORMS, ("re:.*post_attention_layernorm$", ("re:.*mlp.gate$", "re:.*gate_proj$", "re:.*up_proj$"),
                         None), _UP_DOWN): ("DeepseekV3ForCausalLM",),
    _MLA_DENSE_FIRST: ("DeepseekV2ForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM"),
    (("re:.*input_layernorm$", ("re:.*query_key_value$",), None),
     ("re:.*post_attention_layernorm$", ("re:.*dense_h_to_4h$",), None),
     ("re:.*gelu_impl$", ("re:.*dense_4h_to_h$",), None)): ("BloomForCausalLM",),
    (_V_O, _UP_DOWN): ("Exaone4ForCausalLM", "OlmoForCausalLM", "Olmo3ForCausalLM"),
    (("re:.*input_layernorm$", (*_COHERE_ATTENTION, "re:.*self_attn.gate_proj$"), None), _V_O,
     ("re:.*pre_mlp_layernorm$", ("re:.*mlp.router$", "re:.*mlp.*gate_proj$", "re:.*mlp.*up_proj$"), None),
     _UP_DOWN): ("AfmoeForCausalLM",),
    (("re:.*input_layernorm$", _QKV, None), _V_O,
     (r"re:.*language_model\.layers\.\d+\.post_attention_layernorm$",
      (r"re:.*language_model\.layers\.\d+\.mlp\.gate_proj$", r"re:.*language_model\.layers\.\d+\.mlp\.up_proj$"),
      None),
     (r"re:.*language_model\.layers\.\d+\.mlp\.up_proj$", (r"re:.*language_model\.layers\.\d+\.mlp\.down_proj$",),
      None)): ("Qwen2_5_VLForConditionalGeneration",),
}
_AWQ_BY_ARCHITECTURE = {arch: mappings for mappings, archs in _AWQ_MAPPINGS.items() for arch in archs}
# Hybrid attention and mixed dense/sparse stacks: the peer builds these from the layer types; here they must be given.
_AWQ_NO_DEFAULT = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
              "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Step3p5ForCausalLM")


def smoothing_mappings(architecture: str) -> tuple:
    """The peer's SmoothQuant mappings for a model class; the default ones for a class it does not list."""
    if architecture in _SQ_NO_DEFAULT:
        raise UsageError(f"SmoothQuantModifier has no default mappings for {architecture} (hybrid attention): "
                         "give mappings")
    return _SQ_BY_ARCHITECTURE.get(architecture, _SQ_DEFAULT)


def awq_mappings(architecture: str) -> tuple:
    """The peer's AWQ mappings for a model class; the default ones for a class it does not list."""
    if architecture in _AWQ_NO_DEFAULT:
        raise UsageError(f"AWQModifier has no default mappings for {architecture} (its layers differ): give mappings")
    return _AWQ_BY_ARCHITECTURE.get(architecture, _AWQ_DEFAULT)
