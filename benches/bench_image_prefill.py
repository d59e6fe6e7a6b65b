"""Image prefill latency of the emulated mesh vs Hugging Face transformers (same machine, same run).

A mid-size Gemma 3 multimodal model (random weights, fp32): SigLIP tower of 6 layers, hidden 384,
8 heads, 224x224 images of 14-pixel patches (256 patches pooled to 64 soft tokens), text model of
4 layers, hidden 512. One image request's prefill: the vision program on the image, then the
prompt (1 text token + begin-of-image + 64 soft tokens + end-of-image + 60 text tokens = 127,
one prefill bucket of 128) with the soft tokens merged and the image-block mask. transformers:
one ``Gemma3ForConditionalGeneration`` forward on the same ids, pixel values and token types.
Prints the best-of-N latencies and the ratio emulated / transformers per mesh (N150, T3K), and
whether the next token agrees.

``--model qwen2_5_vl``: a Qwen2.5-VL of the same size (vision transformer of 6 layers, hidden
384, 8 heads, windows of 112 pixels with full attention at layers 2 and 5; the 224x224 image is
16x16 patches merged to 64 soft tokens; text 4 layers, hidden 512, M-RoPE), against
``Qwen2_5_VLForConditionalGeneration`` on the same ids, pixel values and patch grid.

Run: .venv/bin/python benches/bench_image_prefill.py [--model gemma3|qwen2_5_vl] [--repeats 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from ttbundle import lower, reference, spec, vision, weights
from ttbundle.plan.make import make_plan
from ttbundle.backends.emulated import EmulatedModel, Runner  # noqa: E402

SPEC = """\
name: bench-gemma3-vl
model:
  family: gemma3
  vocab_size: 4096
  hidden_size: 512
  intermediate_size: 1536
  num_hidden_layers: 4
  num_attention_heads: 8
  num_key_value_heads: 4
  head_dim: 64
  max_position_embeddings: 1024
  sliding_window: 512
  query_pre_attn_scalar: 64
  vision:
    hidden_size: 384
    intermediate_size: 1536
    num_hidden_layers: 6
    num_attention_heads: 8
    image_size: 224
    patch_size: 14
    mm_tokens_per_image: 64
    image_token_index: 4000
    boi_token_index: 4001
    eoi_token_index: 4002
targets: [N150, T3K]
buckets: {prefill: [128], decode: [1], prefill_chunk: 128}
runtime: {max_model_len: 256, max_num_seqs: 1}
vision: {images_per_prompt: 1, buckets: [1]}
"""

QWEN_SPEC = """\
name: bench-qwen25-vl
model:
  family: qwen2_5_vl
  vocab_size: 4096
  hidden_size: 512
  intermediate_size: 1536
  num_hidden_layers: 4
  num_attention_heads: 8
  num_key_value_heads: 4
  max_position_embeddings: 1024
  rope_theta: 1000000.0
  mrope_section: [8, 12, 12]
  vision:
    depth: 6
    hidden_size: 384
    intermediate_size: 1536
    num_heads: 8
    patch_size: 14
    window_size: 112
    fullatt_block_indexes: [2, 5]
    out_hidden_size: 512
    image_token_id: 4000
    video_token_id: 4001
    vision_start_token_id: 4002
    vision_end_token_id: 4003
targets: [N150, T3K]
buckets: {prefill: [128], decode: [1], prefill_chunk: 128}
runtime: {max_model_len: 256, max_num_seqs: 1}
vision: {images_per_prompt: 1, min_pixels: 3136, max_pixels: 50176, buckets: [256]}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=("gemma3", "qwen2_5_vl"), default="gemma3")
    args = ap.parse_args()
    bundle = spec.loads(SPEC if args.model == "gemma3" else QWEN_SPEC, f"bench-{args.model}-vl.yaml")
    part = bundle.family.vision_part(bundle.arch)  # the family's own image inputs and reference
    hf = reference.random_model(bundle, seed=0).to(args.device)
    canon = weights.from_state_dict(bundle.family, bundle.arch, hf.state_dict())
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    img = Image.fromarray((torch.rand(300, 400, 3, generator=g) * 255).to(torch.uint8).numpy())
    if args.model == "qwen2_5_vl":
        img = img.resize((224, 224))  # 16x16 patches: 64 soft tokens, as Gemma's pooled 224x224 image
    inputs = vision.image_inputs(bundle, [img])
    pixels, grid = inputs["pixel_values"].to(args.device), inputs.get("image_grid_thw")
    text = torch.randint(0, 3000, (61,), generator=g).tolist()
    prompt, mm = vision.prompt_with_images(bundle, text, 1, 128, inputs)
    ids = torch.tensor([prompt], device=args.device)
    kw = part.reference_kwargs(bundle.arch.vision, prompt, inputs, args.device)
    rope = part.rope_positions(bundle.arch.vision, prompt, inputs)[0] if hasattr(part, "rope_positions") else None
    print(f"model: {sum(p.numel() for p in hf.parameters()) / 1e6:.0f}M params, fp32, device {args.device}, "
          f"torch threads {torch.get_num_threads()}; prompt {len(prompt)} tokens with 1 image, best of {args.repeats}")

    def best(fn):
        fn()  # warm-up
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
        return min(ts), out

    with torch.no_grad():
        def hf_forward():
            if hasattr(hf.model, "rope_deltas"):
                hf.model.rope_deltas = None  # each call a new prompt (transformers caches the deltas)
            return hf(ids, **kw).logits[0, -1]
        t_hf, out = best(hf_forward)
    ref_tok = int(out.argmax())
    print(f"transformers forward: {t_hf * 1e3:.1f} ms")
    for mesh in ("N150", "T3K"):
        plan = make_plan(bundle, mesh)
        model = EmulatedModel.from_canonical(bundle, plan, canon, lower.lower_all(bundle, plan), device=args.device)
        r = Runner(model)
        blocks = list(range(1, -(-len(prompt) // r.block) + 1))

        def run():
            with torch.no_grad():
                m = dict(mm, embeds=model.encode_images(pixels, None if grid is None else grid.to(args.device)))
                return r.prefill(prompt, blocks, mm=m, rope_positions=rope)
        t, logits = best(run)
        print(f"emulated {mesh}: {t * 1e3:.1f} ms; ratio emulated/transformers {t / t_hf:.2f}x; "
              f"next token {'identical' if int(logits.argmax()) == ref_tok else 'DIFFERS'}")


if __name__ == "__main__":
    main()
