"""The tiny seeded Llama model: determinism, caching, tokenizer, decisive greedy logits.

No vLLM engine here; the model is loaded with transformers on CPU.
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

from hicache.integration import tiny_model as tm


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
        tm.default_cache_root() == Path(tm.__file__).resolve().parent.parent / ".cache" / "models"
    )


def test_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model preset 'huge'.*bench, test"):
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
    assert len(gaps) == 64
    assert statistics.median(gaps) >= 1.0, sorted(gaps)
    assert min(gaps) >= 0.05, sorted(gaps)
