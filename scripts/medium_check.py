#!/usr/bin/env python3
"""Medium checkpoint for the check against transformers (issue 4, item 4), and transformers' f32 logits on it.

Builds, with the pinned transformers 5.23.0, a Flash Next checkpoint with the real config's widths and head counts
(configs/flash-next.json) but 4 layers (its first four layer types: 3 GDN + 1 attention; PLE on layer index 1, i.e.
`ple_layer_ids` [2] as in the real config, one-indexed), 64 experts (top-10, as the real config), a small PLE table
(`ngram_vocab_size_base` 100000) and the MTP head (one layer, as the real config). Every tensor is randomized
(transformers' own init leaves norms and the PLE conv at zero), rounded to BF16 and saved in the release layout the
Rust loader reads (`runtime/src/checkpoint.rs`; the same layout as fixtures/tiny-wrapper: `model.language_model.`
prefix, per-expert experts, the PLE table in `split_ngram_parts` shards plus its buffers, an index, the MTP head in
model-mtp.safetensors). Then transformers runs in f32 on those BF16 values (eager attention, eager experts, TF32 off)
over a random prompt (prefill, no cache), then greedy decoding with a DynamicCache, plus the MTP drafter (the
reference of docs/flash-next.md section 9, from scripts/fixtures/make_fixtures.py) over the prompt's streams.

Usage (the H200 machine: torch there, no network; the pinned transformers comes from an unpacked slim wheel):

    python3 scripts/medium_check.py --out DIR [--transformers SLIM_DIR] [--device cuda|cpu] [--prompt-len 64]
                                    [--steps 32] [--seed 4040] [--attempts 4] [--small] [--indexer-budget N]

`--small` shrinks the widths (hidden 256, vocab 4096, ...) for a quick end-to-end run on a CPU; the layer pattern,
experts and PLE placement stay. DIR receives config.json, the safetensors shards + index, expected.safetensors
(prompt_ids, prefill_logits [n, V], greedy_ids [S], greedy_logits [S, V] (row 0 is the cached prefill's last row;
greedy_ids[t] = argmax(greedy_logits[t])), mtp_streams [n-1, 4D], mtp_tokens [n-1], mtp_logits [n-1, V]) and
expected.json (versions, seed, decision margins: MoE top-k router gap, greedy top-1/top-2 gap).

Prompt seeds are tried (up to --attempts) until every MoE routing decision has a top-k logit gap of at least
--min-router-gap, so an independent f32 implementation (summation order only) cannot flip an expert choice.
"""

import argparse
import json
import os
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--transformers", default=os.environ.get("FLASHPLAN_TRANSFORMERS"),
                    help="directory holding the pinned `transformers` package (put first on sys.path)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="greedy steps (greedy_logits rows)")
    ap.add_argument("--seed", type=int, default=4040)
    ap.add_argument("--attempts", type=int, default=4, help="prompt seeds to try for clear routing margins")
    ap.add_argument("--min-router-gap", type=float, default=1e-4)
    ap.add_argument("--small", action="store_true", help="small widths (a CPU dry run of the whole pipeline)")
    ap.add_argument("--indexer-budget", type=int, default=None,
                    help="override indexer_budget (default: the real config's 2048, so QSA keeps every token)")
    ap.add_argument("--no-mtp", action="store_true", help="leave the MTP head out")
    return ap.parse_args()


A = parse_args()
if A.transformers:
    sys.path.insert(0, os.path.abspath(A.transformers))
sys.path.insert(0, os.path.join(REPO, "scripts", "fixtures"))

import torch  # noqa: E402

import transformers  # noqa: E402

assert transformers.__version__ == "5.23.0", f"need transformers 5.23.0, got {transformers.__version__}"

import make_fixtures as mf  # noqa: E402  (the fixtures' MTP reference, randomization and probes)
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen4ExpForCausalLM  # noqa: E402

# Exact f32 on the GPU: no TF32 in matmuls or convolutions.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")


def text_config() -> dict:
    """The medium `text_config` (HF field names), derived from configs/flash-next.json."""
    with open(os.path.join(REPO, "configs", "flash-next.json")) as f:
        real = json.load(f)["text_config"]
    t = dict(real)
    layers = 4
    t["num_hidden_layers"] = layers
    t["layer_types"] = real["layer_types"][:layers]  # linear x3, full (an indexed-attention layer)
    assert t["layer_types"].count("linear_attention") == 3 and t["layer_types"][3] == "full_attention"
    t["ple_layer_ids"] = [2]  # one-indexed: layer index 1 (as the real config)
    t["num_experts"] = 64
    assert 0 < t["num_experts_per_tok"] <= t["num_experts"]
    t["ngram_vocab_size_base"] = 100000
    if A.indexer_budget:
        t["indexer_budget"] = A.indexer_budget
    if A.small:
        t.update(
            vocab_size=4096, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, hc_lowrank=32, ple_embed_dim=256,
            ngram_vocab_size_base=1000, split_ngram_parts=8, indexer_head_dim=64, bos_token_id=4000,
            eos_token_id=4000, max_position_embeddings=4096,
        )
        t["rope_parameters"] = dict(real["rope_parameters"], mrope_section=[3, 3, 2],
                                    original_max_position_embeddings=2048)
    return t


def device() -> str:
    if A.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return A.device


def wrapper_config(tdict: dict) -> dict:
    with open(os.path.join(REPO, "configs", "flash-next.json")) as f:
        conf = json.load(f)
    conf["text_config"] = tdict
    conf["max_position_embeddings"] = tdict["max_position_embeddings"]
    conf["transformers_version"] = transformers.__version__
    return conf


@torch.no_grad()
def write_checkpoint(path: str, model, mtp, tdict: dict) -> int:
    """The release layout: one shard for embeddings + lm_head + final mixer, one per layer, model-mtp.safetensors."""
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    sd = mf.split_for_disk(model.state_dict(), cfg, per_expert=True, with_ple_buffers=True)
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    L = cfg.num_hidden_layers
    names = [f"model-{i + 1:05d}-of-{L + 1:05d}.safetensors" for i in range(L + 1)]

    def shard_of(k):
        if ".layers." in k:
            return 1 + int(k.split(".layers.")[1].split(".")[0])
        return 0

    weight_map, total = {}, 0
    for i, fn in enumerate(names):
        part = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous().cpu()
                for k, v in sd.items() if shard_of(k) == i}
        save_file(part, os.path.join(path, fn), metadata={"format": "pt"})
        for k, v in part.items():
            weight_map[k] = fn
            total += v.numel() * v.element_size()
        del part
    if mtp is not None:
        mt = {f"mtp.{k}": v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in mtp.state_dict().items()}
        save_file(mt, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
        for k, v in mt.items():
            weight_map[k] = "model-mtp.safetensors"
            total += v.numel() * v.element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(wrapper_config(tdict), f, indent=2)
    return total


def eager_experts(module):
    """Per-expert f32 matmuls in a module built outside from_pretrained (the MTP layer's own config)."""
    for m in module.modules():
        if hasattr(m, "config") and getattr(m.config, "_experts_implementation", "x") is None:
            m.config._experts_implementation = "eager"
    return module


def prompt_ids(seed: int, vocab: int, eos: int, n: int) -> torch.Tensor:
    # On the CPU whatever the default device (main() switches it): the same ids on every machine.
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g, device="cpu")
    while bool((ids == eos).any()):
        bad = ids == eos
        ids[bad] = torch.randint(0, vocab, (int(bad.sum()),), generator=g, device="cpu")
    return ids.to(torch.int64)


def main():
    t0 = time.time()
    dev = device()
    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
    tdict = text_config()
    cfg = mf.hf_text_config(tdict)
    cfg._experts_implementation = "eager"  # per-expert f32 matmuls (no grouped_mm)
    # Built and randomized on the compute device (on the GPU this takes seconds; the CPU's single-threaded init and
    # random draws take minutes at these widths). The draws depend on the device's generator: the checkpoint is
    # deterministic for a given seed and device kind.
    torch.manual_seed(A.seed)
    with torch.device(dev):
        model = Qwen4ExpForCausalLM(cfg).float().eval()
        mtp = None if A.no_mtp else eager_experts(mf.MTP(cfg).float().eval())
    gen = torch.Generator(device=dev).manual_seed(A.seed)
    torch.set_default_device(dev)  # randomize() draws with torch.randn(shape, generator=gen)
    mf.randomize(model, gen, cfg)
    if mtp is not None:
        mf.randomize(mtp, gen, cfg, prefix="mtp.")
    mf.round_trip(model, torch.bfloat16)
    if mtp is not None:
        mf.round_trip(mtp, torch.bfloat16)
    torch.set_default_device("cpu")
    n_params = sum(p.numel() for p in model.parameters()) + (
        sum(p.numel() for p in mtp.parameters()) if mtp is not None else 0)
    print(f"model: {n_params / 1e9:.3f} G parameters, randomized and BF16-rounded in {time.time() - t0:.1f} s",
          flush=True)
    total = write_checkpoint(A.out, model, mtp, tdict)
    print(f"checkpoint: {total / 1e9:.2f} GB BF16 in {A.out} ({time.time() - t0:.1f} s)", flush=True)

    if mtp is None:
        mtp = eager_experts(mf.MTP(cfg).float().eval()).to(dev)  # unused weights: its outputs are not saved
    mf.GREEDY_STEPS = A.steps
    torch.set_default_device(dev)  # compute_expected builds its tensors without a device
    exp = checks = seed = None
    for attempt in range(A.attempts):
        seed = A.seed + 1000 + attempt
        ids = prompt_ids(seed, cfg.vocab_size, cfg.eos_token_id, A.prompt_len).to(dev)
        probe = mf.Probe()
        t1 = time.time()
        exp, checks = mf.compute_expected(model, mtp, ids, probe)
        gap = checks["router_min_topk_logit_gap"]
        print(f"prompt seed {seed}: router min top-k gap {gap:.3e}, greedy min top-1/top-2 gap "
              f"{checks['greedy_min_top1_top2_gap']:.3e} ({time.time() - t1:.1f} s)", flush=True)
        if gap >= A.min_router_gap and checks["router_mismatch_vs_lower_id_rule"] == 0:
            break
    else:
        print("warning: no prompt seed with the wanted routing margin; keeping the last one", flush=True)
    torch.set_default_device("cpu")
    exp = {k: v.detach().cpu().clone().contiguous() for k, v in exp.items()}
    exp.pop("mtp_out_streams", None)
    if A.no_mtp:
        for k in ("mtp_streams", "mtp_tokens", "mtp_logits"):
            exp.pop(k)
    save_file(exp, os.path.join(A.out, "expected.safetensors"), metadata={"format": "pt"})
    g = exp["greedy_logits"].topk(2, dim=-1).values
    p = exp["prefill_logits"].topk(2, dim=-1).values
    summary = {
        "generated_by": "scripts/medium_check.py",
        "transformers": transformers.__version__, "transformers_path": os.path.dirname(transformers.__file__),
        "torch": torch.__version__, "device": dev + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else ""),
        "compute": "float32 (BF16-rounded weights), eager attention, eager experts, TF32 off",
        "small": A.small, "mtp": not A.no_mtp, "weight_seed": A.seed, "prompt_seed": seed,
        "parameters": n_params, "checkpoint_bytes": total,
        "n": int(exp["prompt_ids"].numel()), "steps": A.steps, "vocab": int(cfg.vocab_size),
        "prompt_ids": exp["prompt_ids"].tolist(), "greedy_ids": exp["greedy_ids"].tolist(),
        "greedy_top1_top2_gaps": (g[:, 0] - g[:, 1]).tolist(),
        "prefill_top1_top2_min_gap": (p[:, 0] - p[:, 1]).min().item(),
        "max_abs_logit": checks["max_abs_logit"],
        "checks": checks,
        "seconds": time.time() - t0,
    }
    summary = json.loads(json.dumps(summary), parse_constant=lambda c: None)  # inf/nan -> null
    with open(os.path.join(A.out, "expected.json"), "w") as f:
        json.dump(summary, f, indent=1, allow_nan=False)
    print(json.dumps({k: summary[k] for k in ("transformers", "transformers_path", "torch", "device", "parameters",
                                              "prompt_seed", "max_abs_logit", "seconds")}), flush=True)
    print("checks: " + json.dumps(checks), flush=True)
    print("greedy ids:", summary["greedy_ids"], flush=True)


if __name__ == "__main__":
    main()
