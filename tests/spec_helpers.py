"""Spec builders and error-location helpers shared by the spec/plan/CLI tests.

Spec text is built from a dict with ``yaml.safe_dump`` so tests can say *what* they change and
then find the line a diagnostic must point at with :func:`line_of` (computed from the text, never
copied from ttbundle's output). A module of its own, not conftest.py: tests/runtime has a
conftest too, and ``from conftest import`` would find whichever came first on sys.path.
"""

from __future__ import annotations

import copy
import math

import yaml

SPEC_FILE = "spec.yaml"

# A small Llama whose dims make the arithmetic non-trivial on every mesh:
# hidden 512 = 8 heads x 64, 2 KV heads (replicated on T3K/TG), intermediate 1536, vocab 4096.
TINY = {
    "name": "tiny",
    "description": "test model",
    "model": {
        "family": "llama",
        "vocab_size": 4096,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
    "targets": ["N150"],
    "buckets": {"prefill": [128, 512], "decode": [1, 8, 32], "prefill_chunk": 512},
    "runtime": {"max_model_len": 2048, "max_num_seqs": 32},
}

# text dims as tests/test_emulated.py's tiny Gemma 3; a 64x64 image is 8x8 patches of 8 pixels,
# pooled 2x2 to 16 soft tokens; 8 vision heads split over T3K's 8 columns
TINY_VL = """\
name: tiny-gemma3-vl
model:
  family: gemma3
  vocab_size: 512
  hidden_size: 256
  intermediate_size: 512
  num_hidden_layers: 3
  num_attention_heads: 8
  num_key_value_heads: 4
  head_dim: 32
  max_position_embeddings: 1024
  sliding_window: 48
  query_pre_attn_scalar: 32
  vision:
    hidden_size: 64
    intermediate_size: 128
    num_hidden_layers: 2
    num_attention_heads: 8
    image_size: 64
    patch_size: 8
    mm_tokens_per_image: 16
    image_token_index: 500
    boi_token_index: 501
    eoi_token_index: 502
targets: [N150, N300, T3K]
buckets: {prefill: [64, 128], decode: [1, 8, 32], prefill_chunk: 64}
runtime: {max_model_len: 256, max_num_seqs: 8}
vision: {images_per_prompt: 2, buckets: [1, 2]}
"""

# Llama-3.1-70B's published dims (HF config.json of meta-llama/Llama-3.1-70B).
LLAMA_70B = {
    "name": "llama-3.1-70b",
    "model": {
        "family": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
    },
    "targets": ["T3K"],
}


def deep_update(base: dict, changes: dict) -> dict:
    """``changes`` merged into a copy of ``base``; a value of ``DELETE`` removes the key."""
    out = copy.deepcopy(base)
    for k, v in changes.items():
        if v is DELETE:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_update(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class _Delete:
    def __repr__(self):
        return "DELETE"


DELETE = _Delete()


def dump(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=1000)


def spec_text(changes: dict | None = None, base: dict | None = None) -> str:
    return dump(deep_update(base or TINY, changes or {}))


def _matches(line: str, needle: str) -> bool:
    # "- 3" means a block list item that is exactly 3 (not "- 32")
    return line.strip() == needle if needle.startswith("- ") else needle in line


def line_of(text: str, needle: str, nth: int = 1) -> int:
    """1-based line of the ``nth`` line containing ``needle`` (a list item ``- x``: exactly)."""
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if _matches(line, needle)]
    assert len(hits) >= nth, f"{needle!r} not in spec text:\n{text}"
    return hits[nth - 1]


def col_of(text: str, needle: str, nth: int = 1) -> int:
    """1-based column where ``needle`` starts on its line (a list item ``- x``: where x starts)."""
    line = text.splitlines()[line_of(text, needle, nth) - 1]
    return line.index(needle) + 1 + (2 if needle.startswith("- ") else 0)


# SmolLM2's head ratio (9 query, 3 KV heads) at tiny dims: heads that divide no multi-chip mesh.
SMOL = {"family": "llama", "vocab_size": 512, "hidden_size": 144, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 16,
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "rope_theta": 100000.0}


def smol_spec(mesh: str) -> tuple[str, dict]:
    """The 9/3-head spec for ``mesh`` with the padding `ttbundle init` chooses (its
    ``SHARDING_FALLBACKS``, first that plans): (spec text, the sharding keys it set)."""
    from ttbundle import init, spec as specmod
    from ttbundle.plan.make import check_mesh
    for extra in ({},) + init.SHARDING_FALLBACKS:
        doc = {"name": "tiny-smol", "description": "9 query / 3 KV heads", "model": SMOL, "targets": [mesh],
               "sharding": dict(extra), "buckets": {"prefill": [32, 64], "decode": [1, 2, 4, 8], "prefill_chunk": 64},
               "runtime": {"max_model_len": 256, "max_num_seqs": 8}}
        text = yaml.safe_dump(doc, sort_keys=False)
        if not check_mesh(specmod.loads(text, "smol.yaml"), mesh):
            return text, extra
    raise AssertionError(f"no padding fits {mesh}")


# ---- per-chip bytes from dims (independent of ttbundle.plan) -------------------------------------
def wh_dram(pages: int, page_bytes: int) -> int:
    """An interleaved buffer on a Wormhole chip: 12 banks, each ceil(pages / 12) pages of
    page_bytes rounded up to 32 B."""
    return 12 * math.ceil(pages / 12) * (-(-page_bytes // 32) * 32)


TILE_BYTES = {"bf16": 2048, "bfp8": 1088, "bfp4": 576}


def llama_weights_one_chip(v, d, i, layers, heads, kv, hd, mlp_dtype, other_dtype) -> int:
    """Every Llama weight unsharded on one Wormhole chip: matrices in TILE pages of their dtype,
    the embedding bf16 ROW_MAJOR (a page per row), 1-D norms bf16 rows of 32 values."""
    t = lambda r, c, dt: wh_dram(math.ceil(r / 32) * math.ceil(c / 32), TILE_BYTES[dt])  # noqa: E731
    per_layer = (t(d, heads * hd, other_dtype) * 2 + t(d, kv * hd, other_dtype) * 2
                 + t(d, i, mlp_dtype) * 3 + wh_dram(d // 32, 64) * 2)
    return (wh_dram(v, d * 2) + t(d, v, other_dtype) + wh_dram(d // 32, 64) + layers * per_layer)

# the tiny vision-language specs share their text model's sizes (8 heads of 32, 2 KV heads), their
# targets, buckets and runtime; the two Qwen ones their vision encoder's sizes (8 heads of 8, split
# over T3K's 8 columns; 4-pixel patches merged 2x2), image tokens and image settings (up to 64x64
# pixels = 256 patches, two per prompt in a bucket of 512 patches)
def _tiny_vl(name: str, family: str, layers: int, text: str, vision: str, images: str) -> str:
    return (f"name: {name}\nmodel:\n  family: {family}\n  vocab_size: 512\n  hidden_size: 256\n"
            f"  intermediate_size: 512\n  num_hidden_layers: {layers}\n  num_attention_heads: 8\n"
            "  num_key_value_heads: 2\n  max_position_embeddings: 1024\n" + text + "  vision:\n" + vision +
            "targets: [N150, N300, T3K]\nbuckets: {prefill: [64, 128], decode: [1, 8, 32], prefill_chunk: 128}\n"
            "runtime: {max_model_len: 512, max_num_seqs: 8}\n" + images)


def _qwen_vision(own: str) -> str:
    return ("    depth: 3\n    hidden_size: 64\n    intermediate_size: 96\n    num_heads: 8\n    patch_size: 4\n"
            "    temporal_patch_size: 2\n    spatial_merge_size: 2\n" + own + "    out_hidden_size: 256\n"
            "    image_token_id: 500\n    video_token_id: 501\n    vision_start_token_id: 502\n"
            "    vision_end_token_id: 503\n")


_QWEN_IMAGES = "vision: {images_per_prompt: 2, min_pixels: 256, max_pixels: 4096, buckets: [256, 512]}\n"

# a tiny Qwen2.5-VL: text 2 layers (M-RoPE sections 4/6/6 of its 16 frequencies); vision windows of
# 16 pixels (2x2 blocks), full attention at layer 1
TINY_QVL = _tiny_vl("tiny-qwen25-vl", "qwen2_5_vl", 2, "  rope_theta: 10000.0\n  mrope_section: [4, 6, 6]\n",
                    _qwen_vision("    window_size: 16\n    fullatt_block_indexes: [1]\n"), _QWEN_IMAGES)

# a tiny Qwen3-VL: text 3 layers (interleaved M-RoPE sections 6/5/5 of its 16 frequencies); vision
# a learned 4x4 position embedding resampled to each grid, DeepStack after vision layers 0 and 2
# (added after text layers 0 and 1)
TINY_Q3VL = _tiny_vl("tiny-qwen3-vl", "qwen3_vl", 3, "  rope_theta: 10000.0\n  mrope_section: [6, 5, 5]\n",
                     _qwen_vision("    num_position_embeddings: 16\n    deepstack_visual_indexes: [0, 2]\n"),
                     _QWEN_IMAGES)

# a tiny Mistral 3: Mistral text 3 layers; a Pixtral encoder of 3 layers of 8 heads of 8 (split over
# T3K's 8 columns; Pixtral's own keys), 4-pixel patches merged 2x2; images up to 64 pixels on the
# longer side = 8 x 8 merge blocks = 256 patches, two per prompt in a bucket of 512
TINY_MISTRAL3 = _tiny_vl(
    "tiny-mistral3", "mistral3", 3, "  rms_norm_eps: 1.0e-5\n  rope_theta: 1000000.0\n",
    "    hidden_size: 64\n    intermediate_size: 96\n    num_hidden_layers: 3\n    num_attention_heads: 8\n"
    "    image_size: 64\n    patch_size: 4\n    hidden_act: silu\n    spatial_merge_size: 2\n"
    "    image_token_index: 500\n    image_break_token_index: 501\n    image_end_token_index: 502\n",
    "vision: {images_per_prompt: 2, longest_edge: 64, buckets: [256, 512]}\n")
