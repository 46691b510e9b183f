"""Micro-benchmark: one model step of kvbridge's paged Llama vs Hugging Face forward with a KV cache.

SmolLM2-135M shapes with random weights (no download), the same weights in both models.
Measures prefill of one prompt, then decode steps at each batch size, where every sequence
starts from a `--context`-token prompt; the two models' steps alternate and the
median is reported, so background load hits both alike. kvbridge's time includes building the step's
AttentionMetadata and the logits of the sampled rows; HF's is `model(input_ids, past_key_values)`
(a lower bound on HF `generate`, which adds logits processing and stopping checks).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/model_step.py --batches 1 16 --context 128
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

from kvbridge.engine.layers.attention import AttentionMetadata  # noqa: E402
from kvbridge.engine.models import build_model, kv_cache_shape  # noqa: E402
from kvbridge.shape.model_config import ModelArchConfig, ModelFamily  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
BLOCK_SIZE = 16


def build_pair(dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module, ModelArchConfig]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMOLLM2_135M)
    hf = transformers.LlamaForCausalLM(cfg).to(dtype=dtype, device=device).eval()
    arch = ModelArchConfig(
        family=ModelFamily.LLAMA, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=SMOLLM2_135M["rope_theta"],
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True)
    ours = build_model(arch, dtype, device)
    ours.load_weights(dict(hf.state_dict()))
    return hf, ours, arch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class OursDecoder:
    """kvbridge side: prefill `batch` prompts into a paged cache, then one decode step per call."""

    def __init__(self, model, arch: ModelArchConfig, prompts: torch.Tensor, max_new: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        batch, context = prompts.shape
        self.model, self.device, self.batch = model, device, batch
        blocks_per_seq = -(-(context + max_new + 1) // BLOCK_SIZE)
        self.kv_cache = torch.zeros(kv_cache_shape(arch, batch * blocks_per_seq, BLOCK_SIZE),
                                    dtype=dtype, device=device)
        # Interleave the sequences' blocks, as a block pool would after some churn.
        self.tables = [[b * batch + s for b in range(blocks_per_seq)] for s in range(batch)]
        self.ctx = context
        last = []
        for s in range(batch):
            t0 = time.perf_counter()
            attn = AttentionMetadata.build([context], [context], [self.tables[s]], BLOCK_SIZE, device)
            hidden = model(prompts[s], torch.arange(context, device=device), attn, self.kv_cache)
            last.append(model.compute_logits(hidden[-1:]))
            sync(device)
            if s == 0:
                self.prefill_s = time.perf_counter() - t0
        self.tokens = torch.cat(last).argmax(-1)

    def step(self) -> None:
        self.ctx += 1
        attn = AttentionMetadata.build([1] * self.batch, [self.ctx] * self.batch, self.tables, BLOCK_SIZE,
                                       self.device)
        positions = torch.full((self.batch,), self.ctx - 1, dtype=torch.int64, device=self.device)
        self.tokens = self.model.compute_logits(self.model(self.tokens, positions, attn, self.kv_cache)).argmax(-1)


class HFDecoder:
    """Hugging Face side: forward over the prompts with a DynamicCache, then one token per call."""

    @torch.inference_mode()
    def __init__(self, hf, prompts: torch.Tensor, device: torch.device) -> None:
        self.hf = hf
        t0 = time.perf_counter()
        hf(input_ids=prompts[:1], use_cache=True)
        sync(device)
        self.prefill_s = time.perf_counter() - t0
        out = hf(input_ids=prompts, use_cache=True)
        self.past, self.tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step(self) -> None:
        out = self.hf(input_ids=self.tokens, past_key_values=self.past, use_cache=True)
        self.past, self.tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


def timed(step, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    hf, ours, arch = build_pair(dtype, device)
    print(f"device={device} dtype={args.dtype} threads={args.threads} context={args.context}")
    hf_batch1_tok_s = None
    for batch in args.batches:
        prompts = torch.randint(0, arch.vocab_size, (batch, args.context), device=device)
        ours_dec = OursDecoder(ours, arch, prompts, args.steps, device, dtype)
        hf_dec = HFDecoder(hf, prompts, device)
        ours_t, hf_t = [], []
        for _ in range(args.steps):  # alternate, so both see the same background load
            ours_t.append(timed(ours_dec.step, device))
            hf_t.append(timed(hf_dec.step, device))
        o_dec, h_dec = median(ours_t), median(hf_t)
        print(f"batch {batch:3d}: decode step kvbridge {o_dec * 1e3:7.1f} ms ({batch / o_dec:7.1f} tok/s)"
              f" | HF {h_dec * 1e3:7.1f} ms ({batch / h_dec:7.1f} tok/s) | speedup {h_dec / o_dec:4.2f}x"
              f" | prefill {args.context} tok: kvbridge {ours_dec.prefill_s * 1e3:.0f} ms,"
              f" HF {hf_dec.prefill_s * 1e3:.0f} ms")
        if batch == 1:
            hf_batch1_tok_s = 1 / h_dec
        elif hf_batch1_tok_s:  # HF generate serves concurrent requests one at a time
            print(f"           kvbridge batch {batch} vs HF one request at a time: "
                  f"{batch / o_dec / hf_batch1_tok_s:.2f}x tokens/s")

if __name__ == "__main__":
    main()
