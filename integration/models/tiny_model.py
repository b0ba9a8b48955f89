"""Tiny, seeded, randomly initialised models that vLLM can load without internet.

Contract:

* ``ensure_tiny_model(preset, cache_dir)`` returns a Hugging Face model directory
  (``config.json``, bf16 ``model.safetensors``, tokenizer files with a chat template)
  for one of the :data:`PRESETS`, building it on first use and reusing it afterwards.
* The directory name is ``<preset>-<hash>`` where the hash covers the spec,
  :data:`FORMAT_VERSION` and, for architectures other than Llama, their entry in
  :data:`ARCHITECTURE_FORMAT_VERSIONS`, so any change to these builds a fresh directory.
* Cache root: ``cache_dir``, else ``$HICACHE_MODEL_CACHE``, else ``<repo>/.cache/models``.
* A build happens in a temporary directory next to the final one and is published with
  one ``os.rename``: a crash never leaves a half-built model, and when two processes
  build at once the loser discards its copy and uses the winner's.
* Everything is seeded: two builds give byte-identical weights and the same tokenizer.
* The weights are scaled so that greedy decoding is decisive (large top-1/top-2 logit
  gaps) and depends on the context through attention; see :class:`TinyModelSpec`.
* Architectures (:attr:`TinyModelSpec.architecture`): ``llama`` (presets ``test``,
  ``bench``), ``mistral`` with a sliding window on every layer (preset ``swa``: vLLM gives
  it one KV-cache group of ``SlidingWindowSpec``; preset ``gemma3``: Gemma-3's pattern of
  five sliding-window layers to one full-attention layer, so vLLM's hybrid KV cache
  manager gives it ``SlidingWindowSpec`` and ``FullAttentionSpec`` groups) and
  ``deepseek_v2`` with multi-head latent attention and dense MLPs only (preset ``mla``: one group of ``MLAAttentionSpec``).

Command line: ``python -m hicache.integration.models.tiny_model [--preset P] [--cache-dir DIR]``
prints the model directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

#: Bump when the files written for the same spec change (tokenizer, layout, init).
FORMAT_VERSION = 1

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")

#: role: content lines, then "assistant: " when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_SYLLABLES_ONSET = (
    "",
    *"b c d f g h k l m n p r s t v w z br ch cl dr fr gr pl pr sh st th tr".split(),
)
_SYLLABLES_NUCLEUS = tuple("a e i o u ai ea ee oo ou y".split())
_SYLLABLES_CODA = ("", "", "", *"n r s t l m nd ng st ck".split())
_PUNCTUATION = (".", ".", ".", "!", "?")


#: ``TinyModelSpec.architecture`` -> (HF ``architectures`` entry, HF ``model_type``).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "deepseek_v2"),
    "nemotron_h": ("NemotronHForCausalLM", "nemotron_h"),
}

#: Fields added to :class:`TinyModelSpec` after FORMAT_VERSION 1. :func:`spec_hash` leaves
#: them out while they hold their defaults, so the directories (and files) of the Llama
#: presets did not change when they were added.
_LATER_FIELDS = (
    "architecture",
    "sliding_window",
    "layer_types",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "hybrid_pattern",
)
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

#: Format versions of the architectures added after FORMAT_VERSION 1, part of their hash
#: only (the Llama presets hash FORMAT_VERSION alone): bump one when the files written for
#: that architecture change. deepseek_v2 2: config.json gained the rope_scaling workaround.
ARCHITECTURE_FORMAT_VERSIONS = {"mistral": 1, "deepseek_v2": 2, "nemotron_h": 1}
#: nemotron_h's Mamba2 mixer: state size, groups, conv kernel (heads and head dim are the
#: attention's).
MAMBA_STATE, MAMBA_GROUPS, MAMBA_CONV = 16, 1, 4


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape, seed and initialisation of one tiny model.

    Decisive greedy decoding: every projection that feeds an RMS-normed (unit-RMS) input
    has std ``gain / sqrt(fan_in)``, so its outputs have std ``gain``. Queries and keys use
    ``qk_gain`` (attention-score std ``qk_gain**2`` after the ``1/sqrt(d)`` scaling: peaked
    but not one-hot attention, so outputs depend on the context), everything else
    ``proj_gain``, and the lm_head ``lm_head_gain`` (the logit std, hence the top-1/top-2
    gap). For MLA the same holds for ``q_proj``, the RoPE part of ``kv_a_proj_with_mqa`` and
    the key rows of ``kv_b_proj`` (whose input, the latent, is RMS-normed).
    """

    hidden_size: int  # model width
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # query heads; head_dim = hidden_size // num_attention_heads
    num_key_value_heads: int  # KV heads (GQA when fewer than query heads)
    intermediate_size: int  # SwiGLU MLP width
    vocab_size: int = 2048  # BPE vocabulary target; config.json gets the trained size
    max_position_embeddings: int = 4096  # longest context the config allows
    rope_theta: float = 10000.0  # default (unscaled) RoPE base
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    dtype: str = "bfloat16"  # dtype of the stored weights and of config.json
    seed: int = 1234  # seeds the corpus, the tokenizer training and the weights
    corpus_sentences: int = 20000  # size of the synthetic tokenizer-training corpus
    embed_std: float = 1.0  # std of the token embeddings (input is RMS-normed anyway)
    qk_gain: float = 1.5  # q/k projection std * sqrt(fan_in); attention-score std is qk_gain**2
    proj_gain: float = 1.0  # v/o/MLP projection std * sqrt(fan_in)
    lm_head_gain: float = 40.0  # lm_head std * sqrt(hidden) = logit std; sets the gap size
    # --- added after FORMAT_VERSION 1 (see _LATER_FIELDS); defaults = the Llama presets ---
    architecture: str = "llama"  # a key of ARCHITECTURES
    sliding_window: int | None = None  # mistral only: every layer sees the last N tokens
    # mistral only: "sliding_attention" / "full_attention" per layer (None: all sliding)
    layer_types: tuple[str, ...] | None = None
    # deepseek_v2 only (multi-head latent attention); all but q_lora_rank are required.
    q_lora_rank: int | None = None  # None: a plain q_proj (DeepSeek-V2-Lite); else q_a/q_b
    kv_lora_rank: int | None = None  # latent width; vLLM caches kv_lora_rank + rope dims
    qk_nope_head_dim: int | None = None  # per-head query/key dims without RoPE
    qk_rope_head_dim: int | None = None  # per-head query/key RoPE dims (key part shared)
    v_head_dim: int | None = None  # per-head value dims
    # nemotron_h only: one letter per layer, "M" Mamba2, "*" attention, "-" MLP.
    hybrid_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            allowed = ", ".join(sorted(ARCHITECTURES))
            raise ValueError(f"unknown architecture {self.architecture!r}; allowed: {allowed}")
        if self.sliding_window is not None and self.architecture != "mistral":
            raise ValueError("sliding_window needs architecture 'mistral'")
        if self.layer_types is not None:
            if self.sliding_window is None:
                raise ValueError("layer_types needs a sliding_window")
            kinds = {"sliding_attention", "full_attention"}
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - kinds:
                raise ValueError(f"layer_types must give one of {sorted(kinds)} per layer "
                                 f"({self.num_hidden_layers}), got {self.layer_types}")
        if (self.architecture == "nemotron_h") != (self.hybrid_pattern is not None):
            raise ValueError("architecture 'nemotron_h' and hybrid_pattern go together")
        if self.hybrid_pattern is not None and (
                len(self.hybrid_pattern) != self.num_hidden_layers
                or set(self.hybrid_pattern) - set("M*-")):
            raise ValueError(f"hybrid_pattern needs one of 'M', '*', '-' per layer "
                             f"({self.num_hidden_layers}), got {self.hybrid_pattern!r}")
        mla = [name for name in (*_MLA_FIELDS, "q_lora_rank") if getattr(self, name) is not None]
        if self.architecture == "deepseek_v2":
            missing = [name for name in _MLA_FIELDS if getattr(self, name) is None]
            if missing:
                raise ValueError(f"architecture 'deepseek_v2' needs {', '.join(missing)}")
        elif mla:
            raise ValueError(f"{', '.join(mla)} need architecture 'deepseek_v2'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# Fast enough for unit tests: ~1.6 M parameters. The other small presets are its shapes.
_TEST = TinyModelSpec(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
)
# "test" as a Mistral model whose every layer attends to the last 384 tokens only. Same
# seed and shapes, so the same tokenizer and weights: while a sequence fits in the
# window its greedy output is that of "test".
_SWA = dataclasses.replace(_TEST, architecture="mistral", sliding_window=384)

PRESETS: dict[str, TinyModelSpec] = {
    "test": _TEST,
    # Large enough that prefill compute dominates on CPU: ~93 M parameters.
    "bench": TinyModelSpec(
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
    ),
    "swa": _SWA,
    # Gemma-3's layer pattern on "swa"'s shapes: layers 0-4 attend to the last 384 tokens,
    # layer 5 to everything. vLLM's hybrid manager keeps KV-cache groups of both kinds.
    "gemma3": dataclasses.replace(
        _SWA, num_hidden_layers=6,
        layer_types=("sliding_attention",) * 5 + ("full_attention",),
    ),
    # DeepSeek-V2-Lite-style MLA (no q LoRA), dense MLP in every layer, ~5.3 M parameters.
    # kv_lora_rank + qk_rope_head_dim = 576: the only cached head size vLLM 0.32's MLA
    # backends accept on CPU (80 fails at the first step: "Head dimension 80 is not
    # supported by MLA."). Its CPU platform also forces block_size 16 and turns prefix
    # caching and chunked prefill off for MLA models (without AMX).
    "mla": TinyModelSpec(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=512,
        architecture="deepseek_v2",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
    ),
    # Llama-3-8B widths (GQA 32/8 heads of 128, SwiGLU 14336) on 8 layers, 40k context:
    # ~1.9 G parameters, so a long prefill costs real time on a GPU (the GPU end-to-end
    # run, integration/bench/gpu/e2e.py). 32 KiB of bf16 KV per token.
    "gpu8b": TinyModelSpec(
        hidden_size=4096,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=40960,
        rope_theta=500000.0,
    ),
    # Nemotron-H-style Mamba2 + attention hybrid (Mamba2, attention, Mamba2, MLP), "test"'s
    # widths: vLLM's hybrid manager gives it two MambaSpec groups and one full-attention
    # group. vLLM 0.32's CPU Mamba2 kernel runs it with prefix caching off only.
    "nemotron_h": dataclasses.replace(_TEST, architecture="nemotron_h", hybrid_pattern="M*M-"),
}


def get_spec(preset: str) -> TinyModelSpec:
    """The spec of ``preset``; ValueError naming the allowed presets otherwise."""
    try:
        return PRESETS[preset]
    except KeyError:
        allowed = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown tiny model preset {preset!r}; allowed: {allowed}") from None


def spec_hash(spec: TinyModelSpec) -> str:
    """Short hash of the spec and the format version(s) (part of the directory name)."""
    fields = dataclasses.asdict(spec)
    defaults = {field.name: field.default for field in dataclasses.fields(TinyModelSpec)}
    for name in _LATER_FIELDS:
        if fields[name] == defaults[name]:
            del fields[name]
    versions: dict = {"format_version": FORMAT_VERSION}
    if spec.architecture in ARCHITECTURE_FORMAT_VERSIONS:
        versions["architecture_format_version"] = ARCHITECTURE_FORMAT_VERSIONS[spec.architecture]
    payload = json.dumps({**versions, "spec": fields}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    """``$HICACHE_MODEL_CACHE`` or ``<repo root>/.cache/models``."""
    env = os.environ.get("HICACHE_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache" / "models"


def ensure_tiny_model(preset: str = "test", cache_dir: Path | None = None) -> Path:
    """Return the directory of the ``preset`` model, building it if it is absent."""
    spec = get_spec(preset)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / f"{preset}-{spec_hash(spec)}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)
        build_model(spec, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real error
                raise
    finally:
        if tmp.exists():  # lost the race, or the build failed
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_model(spec: TinyModelSpec, out_dir: Path) -> None:
    """Write the model files of ``spec`` into the existing directory ``out_dir``."""
    tokenizer = _build_tokenizer(spec, out_dir)
    vocab_size = len(tokenizer)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    config = model_config(spec, vocab_size, ids)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_config = {
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    if spec.architecture == "deepseek_v2":
        _write_mla_weights(spec, vocab_size, out_dir / "model.safetensors")
    elif spec.architecture == "nemotron_h":
        _write_nemotron_h_weights(spec, vocab_size, out_dir / "model.safetensors")
    else:  # llama and mistral share the HF weight layout
        _write_weights(spec, vocab_size, out_dir / "model.safetensors")


def model_config(spec: TinyModelSpec, vocab_size: int, ids: dict[str, int]) -> dict:
    """The ``config.json`` contents of ``spec`` (``ids``: special token -> id)."""
    architecture, model_type = ARCHITECTURES[spec.architecture]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "torch_dtype": spec.dtype,
        "use_cache": True,
    }
    if spec.architecture == "mistral":
        del config["attention_bias"], config["mlp_bias"]  # not MistralConfig fields
        config["sliding_window"] = spec.sliding_window
        if spec.layer_types is not None:
            config["layer_types"] = list(spec.layer_types)
    elif spec.architecture == "deepseek_v2":
        config.update(
            {
                "head_dim": spec.qk_rope_head_dim,  # what DeepseekV2Config sets it to
                "q_lora_rank": spec.q_lora_rank,
                "kv_lora_rank": spec.kv_lora_rank,
                "qk_nope_head_dim": spec.qk_nope_head_dim,
                "qk_rope_head_dim": spec.qk_rope_head_dim,
                "v_head_dim": spec.v_head_dim,
                # Plain RoPE written as YaRN with factor 1 (same inverse frequencies, mscale
                # 1: the same cos/sin). vLLM then uses DeepseekScalingRotaryEmbedding, whose
                # CPU path is the PyTorch one. Unscaled RoPE would use RotaryEmbedding's CPU
                # kernel (torch.ops._C.rotary_embedding), which assumes a 2-D
                # [tokens, heads * dim] query and a key whose stride(-2) is the token stride;
                # MLA passes q[..., nope:] as [tokens, heads, rope] and k_pe as a
                # [tokens, 1, rope] view of the latent, so it rotates the wrong elements,
                # reads positions out of bounds and gives batch-dependent garbage.
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 1.0,
                    "original_max_position_embeddings": spec.max_position_embeddings,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
                # No MoE: every layer index is below first_k_dense_replace, so every layer
                # gets a dense MLP. n_routed_experts must still be an int (vLLM's weight
                # loader sizes its expert-name mapping from it), but no expert is built.
                "first_k_dense_replace": spec.num_hidden_layers,
                "moe_layer_freq": 1,
                "n_routed_experts": 2,
                "n_shared_experts": 1,
                "num_experts_per_tok": 1,
                "moe_intermediate_size": spec.intermediate_size,
                "topk_method": "greedy",
                "n_group": None,
                "topk_group": None,
                "norm_topk_prob": False,
                "routed_scaling_factor": 1.0,
            }
        )
    elif spec.architecture == "nemotron_h":
        assert spec.hybrid_pattern is not None
        kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
        config.update({
            "hybrid_override_pattern": spec.hybrid_pattern,
            "layers_block_type": [kinds[c] for c in spec.hybrid_pattern],
            "mamba_num_heads": spec.num_attention_heads,
            "mamba_head_dim": spec.head_dim,
            "ssm_state_size": MAMBA_STATE,
            "n_groups": MAMBA_GROUPS,
            "conv_kernel": MAMBA_CONV,
            "chunk_size": 128,
            "use_conv_bias": True,
            "mamba_hidden_act": "silu",
            "mamba_proj_bias": False,
            "mlp_hidden_act": "relu2",
            "use_bias": False,
            "residual_in_fp32": False,
            "time_step_min": 0.001,
            "time_step_max": 0.1,
            "time_step_floor": 0.0001,
        })
        del config["hidden_act"]
    return config


def _synthetic_corpus(spec: TinyModelSpec) -> list[str]:
    """Seeded English-like sentences made of words assembled from syllables."""
    rng = random.Random(spec.seed)
    lexicon = []
    for _ in range(3000):
        word = "".join(
            rng.choice(_SYLLABLES_ONSET)
            + rng.choice(_SYLLABLES_NUCLEUS)
            + rng.choice(_SYLLABLES_CODA)
            for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )
        lexicon.append(word)
    # Zipf-like word frequencies, as in natural text.
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    sentences = []
    for _ in range(spec.corpus_sentences):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(4, 14))
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        if rng.random() < 0.2:
            words[rng.randrange(len(words) - 1)] += ","
        sentences.append(" ".join(words).capitalize() + rng.choice(_PUNCTUATION))
    return sentences


def _build_tokenizer(spec: TinyModelSpec, out_dir: Path):  # noqa: ANN202 - lazy import
    """Train a byte-level BPE on the synthetic corpus and save it as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(spec), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    # Keep the template inside tokenizer_config.json too (older loaders only read it there).
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return fast


def _write_weights(spec: TinyModelSpec, vocab_size: int, path: Path) -> None:
    """Seeded Gaussian weights in HF Llama layout, stored in ``spec.dtype``."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_key_value_heads * hd

    def gauss(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * std).to(dtype).contiguous()

    def proj(rows: int, cols: int, gain: float) -> torch.Tensor:
        return gauss(rows, cols, gain / math.sqrt(cols))

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": gauss(vocab_size, h, spec.embed_std)
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = proj(q_out, h, spec.qk_gain)
        tensors[p + "self_attn.k_proj.weight"] = proj(kv_out, h, spec.qk_gain)
        tensors[p + "self_attn.v_proj.weight"] = proj(kv_out, h, spec.proj_gain)
        tensors[p + "self_attn.o_proj.weight"] = proj(h, q_out, spec.proj_gain)
        tensors[p + "mlp.gate_proj.weight"] = proj(inter, h, spec.proj_gain)
        tensors[p + "mlp.up_proj.weight"] = proj(inter, h, spec.proj_gain)
        tensors[p + "mlp.down_proj.weight"] = proj(h, inter, spec.proj_gain)
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    tensors["model.norm.weight"] = torch.ones(h, dtype=dtype)
    tensors["lm_head.weight"] = proj(vocab_size, h, spec.lm_head_gain)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_nemotron_h_weights(spec: TinyModelSpec, vocab_size: int, path: Path) -> None:
    """Seeded weights in HF Nemotron-H layout: Mamba2 mixers, attention, relu2 MLPs."""
    import torch
    from safetensors.torch import save_file

    assert spec.hybrid_pattern is not None
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, hd, heads = spec.hidden_size, spec.head_dim, spec.num_attention_heads
    inner = heads * hd  # Mamba2 inner width
    conv_dim = inner + 2 * MAMBA_GROUPS * MAMBA_STATE

    def gauss(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype).contiguous()

    def proj(rows: int, cols: int, gain: float) -> torch.Tensor:
        return gauss(rows, cols, std=gain / math.sqrt(cols))

    # Time steps from 0.01 to 0.1 (as softplus(dt_bias)), decay rates 1..heads.
    dt = torch.linspace(0.01, 0.1, heads)
    tensors: dict[str, torch.Tensor] = {"model.embeddings.weight": gauss(vocab_size, h,
                                                                         std=spec.embed_std)}
    for i, kind in enumerate(spec.hybrid_pattern):
        p = f"model.layers.{i}."
        tensors[p + "norm.weight"] = torch.ones(h, dtype=dtype)
        m = p + "mixer."
        if kind == "M":
            tensors[m + "in_proj.weight"] = proj(2 * inner + 2 * MAMBA_GROUPS * MAMBA_STATE
                                                 + heads, h, spec.proj_gain)
            tensors[m + "conv1d.weight"] = gauss(conv_dim, 1, MAMBA_CONV,
                                                 std=1 / math.sqrt(MAMBA_CONV))
            tensors[m + "conv1d.bias"] = torch.zeros(conv_dim, dtype=dtype)
            tensors[m + "A_log"] = torch.log(torch.arange(1, heads + 1, dtype=torch.float32)
                                             ).to(dtype)
            tensors[m + "D"] = torch.ones(heads, dtype=dtype)
            tensors[m + "dt_bias"] = (dt + torch.log(-torch.expm1(-dt))).to(dtype)
            tensors[m + "norm.weight"] = torch.ones(inner, dtype=dtype)
            tensors[m + "out_proj.weight"] = proj(h, inner, spec.proj_gain)
        elif kind == "*":
            q_out, kv_out = heads * hd, spec.num_key_value_heads * hd
            tensors[m + "q_proj.weight"] = proj(q_out, h, spec.qk_gain)
            tensors[m + "k_proj.weight"] = proj(kv_out, h, spec.qk_gain)
            tensors[m + "v_proj.weight"] = proj(kv_out, h, spec.proj_gain)
            tensors[m + "o_proj.weight"] = proj(h, q_out, spec.proj_gain)
        else:
            tensors[m + "up_proj.weight"] = proj(spec.intermediate_size, h, spec.proj_gain)
            tensors[m + "down_proj.weight"] = proj(h, spec.intermediate_size, spec.proj_gain)
    tensors["model.norm_f.weight"] = torch.ones(h, dtype=dtype)
    tensors["lm_head.weight"] = proj(vocab_size, h, spec.lm_head_gain)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_mla_weights(spec: TinyModelSpec, vocab_size: int, path: Path) -> None:
    """Seeded Gaussian weights in HF DeepSeek-V2 layout (MLA, dense MLPs), in ``spec.dtype``.

    Gains as in :func:`_write_weights`: queries, the RoPE key part of
    ``kv_a_proj_with_mqa`` and the key rows of ``kv_b_proj`` (its input, the latent, is
    RMS-normed) get ``qk_gain``; values, the latent itself, o_proj and the MLP
    ``proj_gain``.
    """
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, inter, heads = spec.hidden_size, spec.intermediate_size, spec.num_attention_heads
    lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    nope, v_dim = spec.qk_nope_head_dim, spec.v_head_dim
    assert lora is not None and rope is not None and nope is not None and v_dim is not None

    def proj(rows: int, cols: int, gain: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (gain / math.sqrt(cols))

    def store(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).contiguous()

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": store(
            torch.randn(vocab_size, h, generator=gen) * spec.embed_std
        )
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        if spec.q_lora_rank is None:
            tensors[p + "q_proj.weight"] = store(proj(heads * (nope + rope), h, spec.qk_gain))
        else:
            tensors[p + "q_a_proj.weight"] = store(proj(spec.q_lora_rank, h, spec.proj_gain))
            tensors[p + "q_a_layernorm.weight"] = torch.ones(spec.q_lora_rank, dtype=dtype)
            tensors[p + "q_b_proj.weight"] = store(
                proj(heads * (nope + rope), spec.q_lora_rank, spec.qk_gain)
            )
        # Rows: the latent (lora), then the RoPE key shared by all heads (rope).
        tensors[p + "kv_a_proj_with_mqa.weight"] = store(
            torch.cat([proj(lora, h, spec.proj_gain), proj(rope, h, spec.qk_gain)])
        )
        tensors[p + "kv_a_layernorm.weight"] = torch.ones(lora, dtype=dtype)
        # Rows per head: its non-RoPE key (nope), then its value (v_dim).
        tensors[p + "kv_b_proj.weight"] = store(
            torch.cat(
                [
                    block
                    for _ in range(heads)
                    for block in (
                        proj(nope, lora, spec.qk_gain),
                        proj(v_dim, lora, spec.proj_gain),
                    )
                ]
            )
        )
        tensors[p + "o_proj.weight"] = store(proj(h, heads * v_dim, spec.proj_gain))
        p = f"model.layers.{i}."
        tensors[p + "mlp.gate_proj.weight"] = store(proj(inter, h, spec.proj_gain))
        tensors[p + "mlp.up_proj.weight"] = store(proj(inter, h, spec.proj_gain))
        tensors[p + "mlp.down_proj.weight"] = store(proj(h, inter, spec.proj_gain))
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    tensors["model.norm.weight"] = torch.ones(h, dtype=dtype)
    tensors["lm_head.weight"] = store(proj(vocab_size, h, spec.lm_head_gain))
    save_file(tensors, str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="test", choices=sorted(PRESETS))
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.preset, args.cache_dir))


if __name__ == "__main__":
    main()
