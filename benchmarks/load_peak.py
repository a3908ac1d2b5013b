"""Weight upload through the staging buffer: load a model whose largest tensor is over
1 GiB and report the staging buffer's peak pinned bytes against its cap.

  python benchmarks/load_peak.py --device cuda --vocab 262144 --hidden 4096 [--out DIR]

Writes a 2-layer llama-shaped HF directory with random bf16 weights (embedding and output
head of vocab x hidden: 2 GiB each at the defaults), loads it with kvferry, and prints
one JSON line: largest tensor bytes, staging cap, staging peak bytes, load seconds.
"""

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from kvferry.config import EngineConfig
from kvferry.engine.engine import Engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    h, v = a.hidden, a.vocab
    with tempfile.TemporaryDirectory() as d:
        cfg = dict(model_type="llama", vocab_size=v, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=2,
                   num_attention_heads=h // 128, num_key_value_heads=max(1, h // 512), head_dim=128,
                   max_position_embeddings=4096, tie_word_embeddings=False)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        g = torch.Generator().manual_seed(0)

        def r(*shape):
            return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        kv = cfg["num_key_value_heads"] * 128
        t = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
             "lm_head.weight": r(v, h)}
        for i in range(2):
            p = f"model.layers.{i}."
            t.update({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                      p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                      p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.k_proj.weight": r(kv, h),
                      p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, h),
                      p + "mlp.gate_proj.weight": r(2 * h, h), p + "mlp.up_proj.weight": r(2 * h, h),
                      p + "mlp.down_proj.weight": r(h, 2 * h)})
        largest = max(x.numel() * x.element_size() for x in t.values())
        save_file(t, os.path.join(d, "model.safetensors"))
        del t
        t0 = time.perf_counter()
        eng = Engine(EngineConfig(model=d, device=a.device, dtype="bf16", ctx_size=64), progress=False)
        load_s = time.perf_counter() - t0
        from kvferry.transport.staging import get_staging
        st = get_staging(eng.device) if eng.device.type == "cuda" else None
        res = dict(largest_tensor_bytes=largest, staging_cap_bytes=st.cap_bytes if st else None,
                   staging_peak_bytes=st.peak_bytes if st else None, load_s=round(load_s, 2),
                   within_cap=(st.peak_bytes <= st.cap_bytes) if st else None, device=str(eng.device))
        print(json.dumps(res))
        if a.out:
            with open(os.path.join(a.out, "load_peak.json"), "w") as f:
                json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
