"""Architectures as records: what each supported family is, in one row, and where its tensors live in a GGUF file
(names and metadata keys as llama.cpp's converter writes them) and in a Hugging Face checkpoint.

Everything else follows from a record: the loaders' tensor tables, the config's variations (``LlamaConfig``: biases,
q/k norms, post-norms, sliding windows, the activation), and from the config the float forward
(``tmac.models.family.llama``), the decode plan and its generated glue (``tmac.models.run.decode``). Adding a family is a record
here and its tests (docs/design.md, "Adding a family").

Our parameter names are the model's module paths. Per layer they are formatted with ``{i}``; the GGUF prefix is
``blk.{i}.``, the Hugging Face one ``model.layers.{i}.``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# ours → (GGUF, Hugging Face), every family
GLOBAL = {"tok_embeddings.weight": ("token_embd.weight", "model.embed_tokens.weight"),
          "norm.weight": ("output_norm.weight", "model.norm.weight"),
          "output.weight": ("output.weight", "lm_head.weight")}
LAYER = {"attention_norm.weight": ("attn_norm.weight", "input_layernorm.weight"),
         "ffn_norm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight"),
         "attention.wq.weight": ("attn_q.weight", "self_attn.q_proj.weight"),
         "attention.wk.weight": ("attn_k.weight", "self_attn.k_proj.weight"),
         "attention.wv.weight": ("attn_v.weight", "self_attn.v_proj.weight"),
         "attention.wo.weight": ("attn_output.weight", "self_attn.o_proj.weight"),
         "feed_forward.w1.weight": ("ffn_gate.weight", "mlp.gate_proj.weight"),
         "feed_forward.w3.weight": ("ffn_up.weight", "mlp.up_proj.weight"),
         "feed_forward.w2.weight": ("ffn_down.weight", "mlp.down_proj.weight")}
# the variations' tensors, named once; a record lists those it has
QKV_BIAS = {"attention.wq.bias": ("attn_q.bias", "self_attn.q_proj.bias"),
            "attention.wk.bias": ("attn_k.bias", "self_attn.k_proj.bias"),
            "attention.wv.bias": ("attn_v.bias", "self_attn.v_proj.bias")}
QK_NORM = {"attention.q_norm.weight": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
           "attention.k_norm.weight": ("attn_k_norm.weight", "self_attn.k_norm.weight")}
SUB_NORMS = {"attention.out_norm.weight": ("attn_sub_norm.weight", "self_attn.attn_sub_norm.weight"),
             "feed_forward.hidden_norm.weight": ("ffn_sub_norm.weight", "mlp.ffn_sub_norm.weight")}
POST_NORMS = {"ffn_norm.weight": ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
              "post_attention_norm.weight": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
              "post_ffn_norm.weight": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight")}
# fused projections: ours → the unfused parts whose rows they stack; a file may store either (Phi-3 stores fused)
FUSED = {"attention.wqkv.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
         "feed_forward.w13.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight")}
FUSED_NAMES = {"attention.wqkv.weight": ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
               "feed_forward.w13.weight": ("ffn_up.weight", "mlp.gate_up_proj.weight")}


def _fixed(default: bool):
    return field(default=default, metadata={"fixed": True})


@dataclass(frozen=True)
class Architecture:
    name: str  # the family: LlamaConfig.arch, a .tmac file's "family"
    models: str  # what people know it as (the README's table)
    gguf: str  # general.architecture
    hf: tuple[str, ...]  # config.json "architectures"
    gguf_activation: str = "silu"  # of the gated FFN (tmac.base.glue.ACTIVATIONS), as llama.cpp computes the family
    hf_activations: tuple[str, ...] = ("silu",)  # config.json's hidden_act values taken (HF_ACTIVATIONS)
    # the family's computation, handed to the config as it is (``config_flags``): each a ``LlamaConfig`` field
    qkv_bias: bool = _fixed(False)  # Qwen2: biases on q, k and v
    qk_norm: bool = _fixed(False)  # Qwen3, Gemma 3: q and k normalized head by head
    sub_norms: bool = _fixed(False)  # BitNet: norms before the output and down projections
    post_norms: bool = _fixed(False)  # Gemma: norms after attention and FFN (the FFN's input norm has another HF name)
    pre_norms: bool = _fixed(True)  # the attention's and the FFN's input norms (OLMo 2 has none: post-norms only)
    qk_norm_whole: bool = _fixed(False)  # OLMo 2: q and k normalized over all their heads at once, not head by head
    hf_norm_shift: float = 0.0  # Hugging Face stores norm weights as w − shift (Gemma: (1 + w)·x̂; GGUF stores w)
    embed_scale: bool = False  # embeddings × √dim
    gguf_interleaved_qk: bool = False  # llama.cpp's converter interleaves q/k rows for its non-NEOX RoPE (llama)
    fused: bool = False  # q|k|v and gate|up stored as one tensor each (a file may still store them apart)
    gguf_swa_every: int = 0  # GGUF: every n-th layer full attention, the others a sliding window (Gemma 3)
    gguf_local_rope_theta: float = 0.0  # GGUF: the sliding layers' RoPE base, which llama.cpp fixes (Gemma 3)
    hf_variants: dict = field(default_factory=dict)  # a config.json key → what it must be (else refused)
    # the family's own scalars, read by both loaders as they are: a LlamaConfig field → its GGUF key (after
    # "{general.architecture}.") and its config.json key; a file without one gets the field's default
    gguf_keys: dict = field(default_factory=dict)
    hf_keys: dict = field(default_factory=dict)
    typical: dict = field(default_factory=dict)  # values of its keyed scalars as real files have them (synthetic files)
    gguf_nope_every: int = 0  # GGUF: every n-th layer without RoPE, which llama.cpp fixes (SmolLM3: 4)

    def layer_tensors(self) -> dict[str, tuple[str, str]]:
        """Ours → (GGUF, Hugging Face) of one layer's tensors, unfused."""
        table = dict(LAYER)
        for present, extra in ((self.qkv_bias, QKV_BIAS), (self.qk_norm, QK_NORM), (self.sub_norms, SUB_NORMS),
                               (self.post_norms, POST_NORMS)):
            if present:
                table.update(extra)
        if not self.pre_norms:
            del table["attention_norm.weight"], table["ffn_norm.weight"]
        return table

    def config_flags(self) -> dict:
        """The ``LlamaConfig`` fields a family fixes, whatever the file says: its record's fixed variations."""
        return dict(arch=self.name, **{f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("fixed")})

    def norms(self) -> list[str]:
        """Our names of one layer's norm weights."""
        return [n for n in self.layer_tensors() if n.endswith("norm.weight")]


# Gemma's soft caps on the attention's scores and the logits, under the same key in both formats
SOFTCAPS = {"attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping"}
ARCHITECTURES = {a.name: a for a in (
    Architecture("llama", "Llama 2 to 3.2, SmolLM, Mistral, Falcon 3", "llama",
                 ("LlamaForCausalLM", "MistralForCausalLM"), gguf_interleaved_qk=True),
    # llama.cpp's "bitnet" is 1bitLLM's BitNet b1.58 (SiLU); BitNet b1.58 2B4T (Microsoft's) uses squared ReLU
    Architecture("bitnet", "BitNet b1.58", "bitnet",
                 ("BitNetForCausalLM", "BitnetForCausalLM"), hf_activations=("relu2", "silu"), sub_norms=True),
    Architecture("qwen2", "Qwen2, Qwen2.5", "qwen2", ("Qwen2ForCausalLM",), qkv_bias=True,
                 hf_variants={"use_sliding_window": False}),
    Architecture("qwen3", "Qwen3 (dense)", "qwen3", ("Qwen3ForCausalLM",), qk_norm=True,
                 hf_variants={"use_sliding_window": False}),
    Architecture("gemma2", "Gemma 2", "gemma2", ("Gemma2ForCausalLM",), gguf_activation="gelu_tanh",
                 hf_activations=("gelu_pytorch_tanh", "gelu_tanh"), post_norms=True, hf_norm_shift=1.0,
                 embed_scale=True, gguf_swa_every=2, gguf_keys=SOFTCAPS, hf_keys=SOFTCAPS,
                 typical={"attn_softcap": 50.0, "final_softcap": 30.0}),
    Architecture("gemma3", "Gemma 3 (text)", "gemma3", ("Gemma3ForCausalLM",), gguf_activation="gelu_tanh",
                 hf_activations=("gelu_pytorch_tanh", "gelu_tanh"), qk_norm=True, post_norms=True,
                 hf_norm_shift=1.0, embed_scale=True, gguf_swa_every=6, gguf_local_rope_theta=10000.0,
                 gguf_keys=SOFTCAPS, hf_keys=SOFTCAPS),
    Architecture("phi3", "Phi-3, Phi-3.5, Phi-4-mini", "phi3", ("Phi3ForCausalLM",), fused=True),
    Architecture("granite", "Granite 3.x (dense)", "granite", ("GraniteForCausalLM",), gguf_interleaved_qk=True,
                 gguf_keys={"embed_scale": "embedding_scale", "residual_scale": "residual_scale",
                            "attn_scale": "attention.scale", "logit_scale": "logit_scale"},
                 hf_keys={"embed_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                          "attn_scale": "attention_multiplier", "logit_scale": "logits_scaling"},
                 typical={"embed_scale": 12.0, "residual_scale": 0.22, "attn_scale": 0.015625, "logit_scale": 8.0}),
    Architecture("olmo2", "OLMo 2", "olmo2", ("Olmo2ForCausalLM",), qk_norm=True, qk_norm_whole=True,
                 post_norms=True, pre_norms=False),
    Architecture("smollm3", "SmolLM3", "smollm3", ("SmolLM3ForCausalLM",), gguf_interleaved_qk=True,
                 gguf_nope_every=4, hf_variants={"use_sliding_window": False}),
)}
HF_ACTIVATIONS = {"silu": "silu", "relu2": "relu2", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
BY_GGUF = {a.gguf: a for a in ARCHITECTURES.values()}
BY_HF = {hf: a for a in ARCHITECTURES.values() for hf in a.hf}


def tensor_names(arch: Architecture, name: str) -> tuple[str, str]:
    """(GGUF, Hugging Face) names of our parameter ``name`` (``layers.{i}.…`` for a layer's)."""
    if name in GLOBAL:
        return GLOBAL[name]
    _, i, rest = name.split(".", 2)
    gguf, hf = {**arch.layer_tensors(), **FUSED_NAMES}[rest]
    return f"blk.{i}.{gguf}", f"model.layers.{i}.{hf}"


def model_table() -> str:
    """The README's table of supported families (markdown)."""
    rows = ["| family (GGUF's too) | models | Hugging Face |", "|---|---|---|"]
    rows += [f"| `{a.name}`{'' if a.gguf == a.name else f' (`{a.gguf}`)'} | {a.models} | "
             f"{', '.join(f'`{h}`' for h in a.hf)} |" for a in ARCHITECTURES.values()]
    return "\n".join(rows)
