"""The tiny seeded models: determinism, caching, tokenizer, decisive greedy logits.

No vLLM engine here; the models are loaded with transformers on CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from hicache.integration.models import tiny_model as tm


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tm.ensure_tiny_model("test", tmp_path_factory.mktemp("models"))


def test_layout_and_config(model_dir):
    import json

    assert model_dir.name.startswith("test-")
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    spec = tm.PRESETS["test"]
    assert config["num_key_value_heads"] == spec.num_key_value_heads == 2
    assert config["head_dim"] == 32
    assert config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is False
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        head = f.get_tensor("lm_head.weight")
    assert emb.dtype == torch.bfloat16
    assert emb.shape == head.shape == (config["vocab_size"], spec.hidden_size)


def test_two_builds_are_identical(model_dir, tmp_path):
    other = tm.ensure_tiny_model("test", tmp_path)
    assert other.name == model_dir.name
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha256(other / name) == _sha256(model_dir / name), name


def test_second_call_reuses_the_cache(model_dir, monkeypatch):
    weights = model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tm, "build_model", no_build)
    assert tm.ensure_tiny_model("test", model_dir.parent) == model_dir
    assert weights.stat().st_mtime_ns == mtime
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name]


def test_lost_race_uses_the_winners_directory(model_dir, tmp_path, monkeypatch):
    final = tmp_path / model_dir.name

    def racing_build(spec, out_dir):
        # Another process publishes its build while ours is still running.
        shutil.copytree(model_dir, final)
        (final / "winner").write_text("")
        (out_dir / "loser").write_text("")

    monkeypatch.setattr(tm, "build_model", racing_build)
    assert tm.ensure_tiny_model("test", tmp_path) == final
    assert (final / "winner").exists() and not (final / "loser").exists()
    assert [p.name for p in tmp_path.iterdir()] == [final.name]  # temp dir cleaned up


def test_spec_change_changes_the_directory():
    spec = tm.PRESETS["test"]
    assert tm.spec_hash(dataclasses.replace(spec, seed=spec.seed + 1)) != tm.spec_hash(spec)
    assert tm.spec_hash(tm.PRESETS["bench"]) != tm.spec_hash(spec)


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HICACHE_MODEL_CACHE", str(tmp_path))
    assert tm.default_cache_root() == tmp_path
    monkeypatch.delenv("HICACHE_MODEL_CACHE")
    assert (
        tm.default_cache_root() == Path(tm.__file__).resolve().parents[2] / ".cache" / "models"
    )


def test_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model preset 'huge'.*bench, gemma3, gpu8b, mla, nemotron_h, swa, test"):
        tm.ensure_tiny_model("huge", tmp_path)
    assert not list(tmp_path.iterdir())


def test_tokenizer_round_trip(model_dir):
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    assert len(tok) == config["vocab_size"] <= tm.PRESETS["test"].vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
        config["pad_token_id"],
    )
    assert tok.unk_token == "<unk>"
    text = "The shastreen pordal went home, 42 times!  Unicode: naïve café 日本 ✓\nNext line."
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    # The synthetic corpus taught the BPE real merges: English-like text compresses.
    assert len(tok("Brandoo tree fastand the cloun.")["input_ids"]) < 20

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s>system: Be brief.\nuser: Hi\nassistant: "
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == "<s>system: Be brief.\nuser: Hi\n"


def test_greedy_logits_are_decisive(model_dir):
    """Top-1 minus top-2 logit over 64 greedily generated positions (float32, HF).

    Measured with the "test" preset: median gap 7.2, minimum 0.31 over these 64
    positions. Over 576 positions of longer prompts: median 7.9, 1st percentile
    0.05, 5th percentile 0.54; no collapse into a repeated token (longest run 2).
    The gap scales with lm_head_gain, but so does the logit noise caused by slightly
    different KV, so bf16 decode-vs-prefill argmax still disagrees at about 1-2% of
    positions (0 in float32).
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    gaps = _greedy_top2_gaps(model, vocab)
    assert len(gaps) == 64
    assert statistics.median(gaps) >= 1.0, sorted(gaps)
    assert min(gaps) >= 0.05, sorted(gaps)


# --- the "swa" (Mistral, sliding window) and "mla" (DeepSeek-V2, MLA) presets ---


def test_llama_preset_directories_did_not_move():
    """Fields added for the new architectures stay out of the Llama presets' hashes."""
    assert tm.spec_hash(tm.PRESETS["test"]) == "63e48a98ca88"
    assert tm.spec_hash(tm.PRESETS["bench"]) == "32b70e68c0af"
    assert tm.PRESETS["test"].architecture == "llama"
    # Any new field that is set does change the hash.
    swa_like = dataclasses.replace(tm.PRESETS["test"], architecture="mistral")
    assert tm.spec_hash(swa_like) != tm.spec_hash(tm.PRESETS["test"])
    assert tm.spec_hash(dataclasses.replace(swa_like, sliding_window=384)) == tm.spec_hash(
        tm.PRESETS["swa"]
    )


def test_architecture_format_version_changes_only_its_presets(monkeypatch):
    before = {name: tm.spec_hash(spec) for name, spec in tm.PRESETS.items()}
    versions = dict(tm.ARCHITECTURE_FORMAT_VERSIONS)
    versions["deepseek_v2"] += 1
    monkeypatch.setattr(tm, "ARCHITECTURE_FORMAT_VERSIONS", versions)
    after = {name: tm.spec_hash(spec) for name, spec in tm.PRESETS.items()}
    assert [name for name in before if before[name] != after[name]] == ["mla"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architecture": "gpt2"}, "unknown architecture 'gpt2'; allowed: deepseek_v2, llama"),
        ({"sliding_window": 384}, "sliding_window needs architecture 'mistral'"),
        ({"kv_lora_rank": 512}, "kv_lora_rank need architecture 'deepseek_v2'"),
        ({"architecture": "deepseek_v2", "kv_lora_rank": 512}, "needs qk_nope_head_dim, qk_rope"),
        ({"architecture": "mistral", "layer_types": ("full_attention",) * 4},
         "layer_types needs a sliding_window"),
        ({"architecture": "mistral", "sliding_window": 8, "layer_types": ("full_attention",)},
         r"one of \['full_attention', 'sliding_attention'\] per layer \(4\)"),
        ({"architecture": "mistral", "sliding_window": 8, "layer_types": ("global",) * 4},
         "per layer"),
    ],
)
def test_invalid_specs(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tm.PRESETS["test"], **changes)


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory) -> Path:
    return tm.ensure_tiny_model("swa", tmp_path_factory.mktemp("swa"))


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory) -> Path:
    return tm.ensure_tiny_model("mla", tmp_path_factory.mktemp("mla"))


def _config(model: Path) -> dict:
    import json

    return json.loads((model / "config.json").read_text())


def test_swa_config_and_files(swa_dir, model_dir):
    assert swa_dir.name == f"swa-{tm.spec_hash(tm.PRESETS['swa'])}"
    config = _config(swa_dir)
    assert config["architectures"] == ["MistralForCausalLM"]
    assert config["model_type"] == "mistral"
    assert config["sliding_window"] == 384
    assert "layer_types" not in config  # a global window: every layer slides
    assert "attention_bias" not in config and "mlp_bias" not in config
    llama = _config(model_dir)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "torch_dtype",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert config[key] == llama[key], key
    # Same seed and shapes as "test": the same tokenizer and the same weights.
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert _sha256(swa_dir / name) == _sha256(model_dir / name), name


def test_swa_window_limits_the_context(swa_dir, model_dir):
    """transformers honours the window: "swa" is "test" inside it and differs beyond it."""
    from transformers import AutoModelForCausalLM

    swa = AutoModelForCausalLM.from_pretrained(str(swa_dir), dtype=torch.float32).eval()
    full = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert type(swa).__name__ == "MistralForCausalLM"
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(4, swa.config.vocab_size) for _ in range(600)]])
    with torch.no_grad():
        a, b = swa(ids).logits[0], full(ids).logits[0]
    assert torch.allclose(a[:384], b[:384], atol=1e-3)
    assert (a[450:].argmax(-1) != b[450:].argmax(-1)).float().mean() > 0.5


def test_mla_config_and_weights(mla_dir):
    from safetensors import safe_open

    assert mla_dir.name == f"mla-{tm.spec_hash(tm.PRESETS['mla'])}"
    config = _config(mla_dir)
    spec = tm.PRESETS["mla"]
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v2"
    assert config["q_lora_rank"] is None
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # vLLM CPU MLA's size
    assert (config["qk_nope_head_dim"], config["v_head_dim"]) == (32, 32)
    # Dense only: no layer index reaches first_k_dense_replace.
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"] == 4
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_scaling"]["factor"] == 1.0
    assert config["torch_dtype"] == "bfloat16"
    heads, h = spec.num_attention_heads, spec.hidden_size
    expected = {
        "self_attn.q_proj.weight": (heads * (32 + 64), h),
        "self_attn.kv_a_proj_with_mqa.weight": (512 + 64, h),
        "self_attn.kv_a_layernorm.weight": (512,),
        "self_attn.kv_b_proj.weight": (heads * (32 + 32), 512),
        "self_attn.o_proj.weight": (h, heads * 32),
        "mlp.gate_proj.weight": (spec.intermediate_size, h),
        "mlp.up_proj.weight": (spec.intermediate_size, h),
        "mlp.down_proj.weight": (h, spec.intermediate_size),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    with safe_open(str(mla_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    want = {f"model.layers.{i}.{k}" for i in range(4) for k in expected}
    want |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert names == want
    for i in range(4):
        for key, shape in expected.items():
            assert shapes[f"model.layers.{i}.{key}"] == shape, key


def test_gemma3_config_interleaves_window_and_full_layers(tmp_path):
    """Five sliding-window layers to one full-attention layer, as Gemma 3; vLLM reads
    ``layer_types`` (the engine tests see one KV-cache group per kind)."""
    built = tm.ensure_tiny_model("gemma3", tmp_path)
    config = _config(built)
    assert config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] == 384 and config["num_hidden_layers"] == 6
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    again = tm.ensure_tiny_model("gemma3", tmp_path / "again")
    assert _sha256(again / "model.safetensors") == _sha256(built / "model.safetensors")
    # The "swa" preset (every layer windowed) keeps its directory: layer_types is unset there.
    assert "layer_types" not in tm.model_config(tm.PRESETS["swa"], 100, dict.fromkeys(
        tm.SPECIAL_TOKENS, 0))


def test_new_presets_are_deterministic(swa_dir, mla_dir, tmp_path):
    for preset, built in (("swa", swa_dir), ("mla", mla_dir)):
        again = tm.ensure_tiny_model(preset, tmp_path)
        assert again.name == built.name
        for name in (
            "model.safetensors",
            "tokenizer.json",
            "config.json",
            "generation_config.json",
        ):
            assert _sha256(again / name) == _sha256(built / name), (preset, name)


def test_mla_rope_scaling_is_plain_rope(mla_dir, tmp_path):
    """The YaRN factor-1 rope_scaling (a vLLM CPU workaround) computes plain RoPE."""
    import json

    from transformers import AutoModelForCausalLM

    plain = tmp_path / "plain"
    shutil.copytree(mla_dir, plain)
    config = _config(plain)
    config["rope_scaling"] = None
    (plain / "config.json").write_text(json.dumps(config))
    ids = torch.tensor([[random.Random(2).randrange(4, 2000) for _ in range(64)]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(mla_dir), dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32)(ids).logits
    assert torch.allclose(a, b, atol=1e-4)


def test_mla_greedy_logits_are_decisive(mla_dir):
    """As test_greedy_logits_are_decisive, for "mla" (measured: median 9.2, minimum 0.14)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(mla_dir), dtype=torch.float32).eval()
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    gaps = _greedy_top2_gaps(model, model.config.vocab_size)
    assert statistics.median(gaps) >= 1.0, sorted(gaps)
    assert min(gaps) >= 0.05, sorted(gaps)


def _greedy_top2_gaps(model, vocab: int) -> list[float]:
    """Top-1 minus top-2 logit of 16 greedy steps on 4 random prompts; the
    generated tokens must not collapse into one."""
    rng = random.Random(0)
    gaps: list[float] = []
    for _ in range(4):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(32, 160))]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=model.config.pad_token_id,
                eos_token_id=None,
            )
        top2 = torch.stack([step[0] for step in out.logits]).topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
        generated = out.sequences[0, len(prompt) :].tolist()
        assert len(set(generated)) >= 8, generated  # not collapsed into one token
    return gaps


def test_nemotron_h_pattern_is_validated():
    with pytest.raises(ValueError, match="hybrid_pattern needs one of"):
        dataclasses.replace(tm.PRESETS["nemotron_h"], hybrid_pattern="M*X-")
    with pytest.raises(ValueError, match="go together"):
        dataclasses.replace(tm.PRESETS["test"], hybrid_pattern="M*M-")
