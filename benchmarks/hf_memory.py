"""A Hugging Face causal LM trained with and without logitless: peak memory and step time.

A ``transformers`` ``LlamaForCausalLM`` with Llama-3-8B widths (H=4096, I=14336, 32 heads,
8 KV heads, V=128256, untied head) but only ``--layers`` decoder layers (default 2), random
bf16 weights, SDPA attention; one training step = ``model(input_ids, labels=labels).loss``
then ``backward()`` (gradients into ``.grad``, cleared before each step as
``zero_grad(set_to_none=True)`` does). Variants, one model patched and unpatched in turn:

* ``hf``: the model's own loss (bf16 logits, upcast to fp32, cross-entropy);
* ``logitless``: ``patch_causal_lm(model)`` (Triton backend, fast setting);
* ``logitless-lowmem``: ``patch_causal_lm(model, low_memory=True)``.

Measured: peak memory during one step (``torch.cuda.max_memory_allocated``) and its excess
over what was allocated before the step (the weights and the batch), median step time over
``--reps`` steps (CUDA events), the loss (the variants must agree), and the relative error of
the LM head's and the embedding's gradients against the ``hf`` variant's.

    PYTHONPATH=. python3 benchmarks/hf_memory.py                     # GPU: 16k tokens
    PYTHONPATH=. python3 benchmarks/hf_memory.py --batch 8 --seq 4096 --layers 4
    PYTHONPATH=. .venv/bin/python benchmarks/hf_memory.py --tiny     # CPU: H=64, V=32000

Result: ``benchmarks/results/<gpu>-hf-llama.json`` (``cpu-hf-llama.json`` on CPU).
"""
from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32000, max_position_embeddings=512,
            tie_word_embeddings=False)
# name -> (what it is, patch_causal_lm keywords on a GPU, on CPU; None = the model's own loss;
# "skip" = does not apply). On CPU the torch backend's default 1 GiB budget would put these
# few tokens in one chunk: 128-token chunks show at small scale what the GPU chunks do.
VARIANTS = {
    "hf": ("the model's own loss: bf16 logits, .float(), cross-entropy", None, None),
    "logitless": ("patch_causal_lm(model): fused linear cross-entropy, default setting", {},
                  {"chunk_size": 128}),
    "logitless-lowmem": ("patch_causal_lm(model, low_memory=True)", {"low_memory": True},
                         "skip"),
}


def build_model(widths, layers, device, dtype, seed):
    import torch
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**widths, num_hidden_layers=layers)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                              dtype=dtype)
    return model.train()


def bench_variant(name, model, batch, *, device, reps, warmup, ref_grads):
    import torch
    from logitless.integrations.transformers import patch_causal_lm, unpatch_causal_lm
    about, tuning_gpu, tuning_cpu = VARIANTS[name]
    tuning = tuning_gpu if device.startswith("cuda") else tuning_cpu
    rec = {"name": name, "about": about, "tuning": tuning}
    if isinstance(tuning, dict) and tuning:
        rec["about"] += " + " + ", ".join(f"{k}={v}" for k, v in tuning.items())
    if tuning == "skip":
        return {**rec, "status": "skipped", "error": "a Triton setting: needs CUDA"}, ref_grads
    unpatch_causal_lm(model)
    if tuning is not None:
        patch_causal_lm(model, **tuning)
    ids, labels = batch

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    try:
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        common.synchronize(device)
        rec["warmup_s"] = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        loss, mem = common.measure_memory(step, device=device, returned_bytes=lambda o: 0)
        rec.update(loss=float(loss), peak_bytes=mem.peak_bytes, base_bytes=mem.base_bytes,
                   peak_over_base_bytes=mem.peak_bytes - mem.base_bytes, memory=mem.as_dict())
        grads = {k: p.grad for k, p in (("lm_head", model.lm_head.weight),
                                       ("embed_tokens", model.model.embed_tokens.weight))}
        if ref_grads is None:
            # on the host: kept on the device they counted in the later variants' memory
            # (2.1 GB at the Llama-3 head: the first README figure overstated our peak by it)
            ref_grads = {k: g.detach().to("cpu", copy=True) for k, g in grads.items()}
        else:
            for k, g in grads.items():
                rec[f"{k}_grad_rel_err"] = common.rel_err(g, ref_grads[k])
        timing = common.time_fn(step, device=device, reps=reps, warmup=0)
        rec.update(status="ok", ms=timing.median_ms, timing=timing.as_dict())
    except Exception as e:  # noqa: BLE001 - e.g. OOM of one variant: the others still run
        rec.update(common.describe_failure(e))
    finally:
        model.zero_grad(set_to_none=True)
        unpatch_causal_lm(model)
        common.free_memory(device)
    return rec, ref_grads


def run(args) -> dict:
    import torch
    device = args.device or common.default_device()
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    widths = TINY if args.tiny else LLAMA3_8B
    dtype = torch.bfloat16
    model = build_model(widths, args.layers, device, dtype, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ids = torch.randint(0, widths["vocab_size"], (args.batch, args.seq), generator=g,
                        device=device)
    labels = ids.clone()
    labels[:, : args.seq // 10] = -100  # a prompt: 10% of the tokens carry no loss
    env = common.environment(device, extra_packages=("transformers",))
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "op": "hf_llama_training_step", "schema": 1, "env": env,
        "config": {"model": "LlamaForCausalLM", "widths": widths, "layers": args.layers,
                   "parameters": n_params, "dtype": "bfloat16", "batch": args.batch,
                   "seq": args.seq, "tokens": args.batch * args.seq, "reps": args.reps,
                   "warmup": args.warmup, "seed": seed, "attn_implementation": "sdpa",
                   "logits_bytes_bf16": 2 * args.batch * args.seq * widths["vocab_size"],
                   "command": " ".join(["python3", "benchmarks/hf_memory.py", *sys.argv[1:]])},
        "variants": [],
    }
    ref_grads = None
    for name in common.progress(args.variants, total=len(args.variants), desc="hf"):
        common.log(f"{name} ...")
        rec, ref_grads = bench_variant(name, model, (ids, labels), device=device,
                                       reps=args.reps, warmup=args.warmup, ref_grads=ref_grads)
        common.log(f"{name}: {rec.get('status')} {rec.get('error', '')}")
        result["variants"].append(rec)
    out = Path(args.out) if args.out else \
        common.RESULTS_DIR / f"{common.device_slug(env)}-hf-llama.json"
    common.write_json(out, result)
    result["json"] = str(out)
    return result


def format_report(result) -> str:
    cfg, env = result["config"], result["env"]
    base = next((v for v in result["variants"] if v["name"] == "hf" and v.get("status") == "ok"),
                None)
    rows = []
    for v in result["variants"]:
        if v.get("status") != "ok":
            rows.append([v["name"], "-", "", "-", "-", "", "", "",
                         f"{v.get('status')}: {v.get('error', '')}"[:60]])
            continue
        rows.append([v["name"], common.fmt_ms(v["ms"]),
                     common.fmt_ratio(v["ms"] / base["ms"]) if base else "-",
                     common.fmt_bytes(v["peak_bytes"]), common.fmt_bytes(v["peak_over_base_bytes"]),
                     f"{v['loss']:.5f}", common.fmt_err(v.get("lm_head_grad_rel_err")),
                     common.fmt_err(v.get("embed_tokens_grad_rel_err")), v["about"]])
    where = env.get("gpu_name") or env.get("cpu_model")
    lines = [
        f"Hugging Face LlamaForCausalLM training step (fwd+bwd), {cfg['layers']} layers of "
        f"H={cfg['widths']['hidden_size']}, V={cfg['widths']['vocab_size']}, "
        f"{cfg['parameters'] / 1e9:.2f}B parameters, bf16, batch {cfg['batch']} x "
        f"{cfg['seq']} = {cfg['tokens']} tokens -- {where}; transformers "
        f"{env['packages'].get('transformers')}, torch {env['packages'].get('torch')}",
        f"(bf16 logits alone: {common.fmt_bytes(cfg['logits_bytes_bf16'])}; peak of one step "
        f"[{next((v['memory']['method'] for v in result['variants'] if v.get('memory')), '-')}]; "
        f"over base = peak minus the weights and batch; "
        f"grad err = ||g - g_hf|| / ||g_hf||)",
        "",
        common.format_table(["", "ms/step", "vs hf", "peak", "over base", "loss",
                             "lm_head grad err", "embed grad err", "what"], rows),
    ]
    if result.get("json"):
        lines += ["", f"wrote {result['json']}"]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=None, help="sequences (default 4 GPU, 2 tiny)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default 4096 GPU: 16k tokens; 256 tiny)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--reps", type=int, default=None, help="timed steps (default 5; 2 tiny)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke run)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; known: {list(VARIANTS)}")
    if a.tiny:
        a.batch, a.seq, a.reps = a.batch or 2, a.seq or 256, a.reps or 2
        if a.out is None:
            a.out = str(Path("/tmp") / "cpu-hf-llama-tiny.json")
    else:
        a.batch, a.seq, a.reps = a.batch or 4, a.seq or 4096, a.reps or 5
    if (a.device or common.default_device()) == "cpu":
        common.release_large_blocks_to_os()
    result = run(a)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
