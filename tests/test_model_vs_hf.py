"""The model runtime against Hugging Face transformers on the same weights (fp32, CPU)."""

import os

import pytest
import torch

from conftest import make_engine

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is 17 * 23?\nA:",
]


@pytest.fixture(scope="module")
def hf_gguf(gguf_path):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                             dtype=torch.float32)
    return m.eval()


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _ours_greedy(eng, ids, n):
    from kvferry.config import SamplingConfig
    return list(eng.generate(ids, n, SamplingConfig(temperature=0), stop_at_eog=False))


def test_gguf_logits_match_transformers(hf_gguf, engine):
    for p in PROMPTS:
        ids = engine.tokenizer.encode(p)
        ours = engine.prefill(0, ids)
        with torch.no_grad():
            ref = hf_gguf(torch.tensor([ids])).logits[0, -1].float()
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-3, f"{p!r}: max abs logit difference {diff}"


def test_gguf_greedy_continuations_match_transformers(hf_gguf, engine):
    for p in PROMPTS:
        ids = engine.tokenizer.encode(p)
        assert _ours_greedy(engine, ids, 32) == _hf_greedy(hf_gguf, ids, 32), p


@pytest.mark.parametrize("fa", [True, False])
def test_multichunk_attention_matches_transformers(hf_gguf, fa):
    """Chunked attention with the log-sum-exp merge (chunks of 16 rows) is the same model,
    with the fused kernel per chunk (-fa on) and with plain matmuls (-fa off)."""
    eng = make_engine(ctx_size=256, kv={"chunk_rows": 16}, ubatch=7, flash_attn=fa)
    ids = eng.tokenizer.encode(PROMPTS[2] + " a fisherman who had never seen a storm.")
    ours = eng.prefill(0, ids)
    with torch.no_grad():
        ref = hf_gguf(torch.tensor([ids])).logits[0, -1].float()
    assert (ours - ref).abs().max().item() < 1e-3
    assert _ours_greedy(eng, ids, 32) == _hf_greedy(hf_gguf, ids, 32)


def _tiny_hf(tmp_path, kind, **extra):
    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[kind]
    torch.manual_seed(0)
    cfg = cls[0](vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 tie_word_embeddings=False, **extra)
    model = cls[1](cfg).eval()
    with torch.no_grad():  # random biases/norms so that qkv bias and q/k norm matter
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path / kind
    model.save_pretrained(d, safe_serialization=True)
    return model, str(d)


@pytest.mark.parametrize("kind,extra", [
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
])
def test_safetensors_checkpoints_match_transformers(tmp_path, kind, extra):
    from kvferry.config import EngineConfig, KVConfig
    from kvferry.engine.generation import Engine
    hf, path = _tiny_hf(tmp_path, kind, **extra)
    eng = Engine(EngineConfig(model=path, device="cpu", dtype="f32", ctx_size=256,
                              kv=KVConfig(chunk_rows=32)), progress=False)
    assert eng.loaded.cfg.arch == kind
    g = torch.Generator().manual_seed(1)
    for n in (5, 40, 100):
        ids = torch.randint(0, 512, (n,), generator=g).tolist()
        ours = eng.prefill(0, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert (ours - ref).abs().max().item() < 1e-3, (kind, n)
        assert _ours_greedy(eng, ids, 32) == _hf_greedy(hf, ids, 32), (kind, n)
