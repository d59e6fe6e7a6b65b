"""A forward's input declarations: the device tensors a run writes before it starts (tokens,
positions, page tables, sampling parameters, an image prefill's soft-token inputs, masks and
rope positions named here), and the static chunk starts of an MLA prefill.

* an image prefill (a model with a vision encoder): its soft tokens are merged after the
  embedding from two inputs (:func:`merge_images`); where its image soft tokens attend to their
  whole image (:func:`image_mask`) its attention takes an explicit mask input (:func:`mask_input`).
* DeepSeek's MLA prefill: ``chunked_flash_mla_prefill`` takes its chunk's start position as a
  static int, so a forward is lowered per chunk start (:func:`chunk_starts`; the runtime keys
  them ``(phase, bucket, sampling, start)``).
"""

from __future__ import annotations

from ... import tiles
from ...program import Program
from .calls import T
from .layout import TILE
from .emitter import DECODE_LIKE, DRAM, Lowerer


def mrope_position_input(row: int) -> str:
    """The input holding each token's M-RoPE position of ``row`` (0 temporal, 1 height, 2 width)."""
    return f"rope_positions.{row}"


def mask_input(window) -> str:
    """The name of the additive attention-mask input (softcapped attention) for a window."""
    return f"attn_mask.w{int(window)}" if window else "attn_mask"


#: the per-row 2-D rope inputs of a Qwen2.5-VL vision layer (cos, sin ``[1, 1, rows, head_dim]``),
#: made on the host from ``image_grid_thw`` (``VisionPart.program_inputs``'s ``cos`` / ``sin``)
VISION_ROPE = ("vision_cos", "vision_sin")


def vision_mask_input(full: bool) -> str:
    """The additive mask input of a Qwen2.5-VL vision layer (0 within a row's window, or its
    image at full-attention layers; -inf elsewhere), made on the host from ``image_grid_thw``."""
    return "vision_mask.image" if full else "vision_mask.window"


#: Qwen3-VL's position-embedding interpolation matrix ``[1, 1, rows, positions]`` (each row's
#: bilinear taps of the learned table, from the vision part's ``pos_idx`` / ``pos_w``)
VISION_POS_INTERP = "vision_pos_interp"

#: every input a vision forward may read, all of which the device runner makes per call
#: (``device.vision_inputs``): the patches, Qwen2.5-VL's and Qwen3-VL's rope and masks, Qwen3-VL's
#: position interpolation
VISION_HOST_INPUTS = ("patches", *VISION_ROPE, vision_mask_input(False), vision_mask_input(True), VISION_POS_INTERP)


def deepstack_input(k: int) -> str:
    """The image prefill input holding the images' DeepStack feature set ``k`` at their image
    tokens' rows (Qwen3-VL; zeros elsewhere), added after text layer ``k``."""
    return f"mm_deepstack.{k}"


def verify_pos_input(j: int) -> str:
    """The input holding the cache position of row ``j`` of each sequence of a verify forward
    (``[bucket]``, -1: no such row). A verify forward's rows are grouped by ``j`` (row
    ``j * bucket + i`` is row ``j`` of sequence ``i``), and the KV writes and the attention run per
    group, as decode runs a batch (:func:`text_ops.row_groups`): one ``paged_update_cache`` per
    group, so no two cores of a call update one KV tile (a sequence's rows are neighbouring
    positions of one block), and every call holds at most a decode bucket's rows (the
    height-sharded writes and the decode SDPA take one core per row)."""
    return f"verify_pos.{j}"


#: a verify forward's page table of its sequences (``[bucket, blocks]``), read by each row group
VERIFY_PAGES = "verify_pages"


def inputs_of(program: Program, bundle) -> dict:
    """The device tensors a run writes before it starts (shape, dtype, layout); page tables in
    the program's KV blocks."""
    rows = program.rows
    if program.phase == "vision":  # the images' patches, flattened like the conv weight
        return {"patches": ((1, 1, rows, bundle.arch.vision.patch_pixels), "bf16", "TILE")}
    B = rows
    block_size = int(program.kv_cache["block_size"])
    blocks_per_seq = tiles.blocks_per_seq(program.dims.max_model_len, block_size)
    ins = {"tokens": ((1, rows), "uint32", "ROW_MAJOR"),
           "positions": ((1, rows), "uint32", "ROW_MAJOR")}
    if program.phase in DECODE_LIKE:  # one token per row: its position, its page-table row
        ins["page_table"] = ((B, blocks_per_seq), "int32", "ROW_MAJOR")
        if program.phase == "decode":
            ins["cur_pos"] = ((B,), "int32", "ROW_MAJOR")
        else:  # verify: each row group's positions and the sequences' pages (``text_ops.row_groups``)
            ins.update({verify_pos_input(j): ((program.bucket,), "int32", "ROW_MAJOR")
                        for j in range(program.rows_per_seq)})
            ins[VERIFY_PAGES] = ((program.bucket, blocks_per_seq), "int32", "ROW_MAJOR")
    else:
        ins["page_table"] = ((1, blocks_per_seq), "int32", "ROW_MAJOR")
        ins["chunk_start"] = ((1,), "int32", "ROW_MAJOR")
        ins["fill_page_table"] = ((1, tiles.cdiv(rows, block_size)), "int32", "ROW_MAJOR")  # the chunk's blocks
        ins["seq_slot"] = ((1,), "int32", "ROW_MAJOR")
        ins["last_rows"] = ((1, 1, min(rows, TILE), rows), "bf16", "TILE")  # one-hot: the last prompt tile row
        if image_prefill(bundle, program):  # the chunk's image soft tokens (merge_images)
            hid = program.dims.hidden_size
            ins["mm_keep"] = ((1, 1, rows, hid), "bf16", "TILE")
            ins["mm_embeds"] = ((1, 1, rows, hid), "bf16", "TILE")
    head_rows = rows if program.phase in DECODE_LIKE else min(rows, TILE)  # rows the head samples
    ins["top_k"] = ((head_rows,), "uint32", "ROW_MAJOR")
    ins["top_p"] = ((head_rows,), "bf16", "ROW_MAJOR")
    ins["temperature"] = ((head_rows,), "bf16", "ROW_MAJOR")
    return ins


def image_prefill(bundle, program: Program) -> bool:
    """Does this forward take images: a prefill of a model with a vision part. Its prefill takes
    the chunk's soft tokens as inputs (``mm_keep``, ``mm_embeds``: :func:`merge_images`)."""
    return program.phase == "prefill" and bundle.family.vision_part(bundle.arch) is not None


def image_mask(bundle, program: Program) -> bool:
    """Does this image prefill attend with an explicit mask input: its family's image soft tokens
    see their whole image (the vision part's ``BIDIRECTIONAL_IMAGES``: Gemma 3), which the
    causal fused SDPA cannot say."""
    part = bundle.family.vision_part(bundle.arch) if program.phase == "prefill" else None
    return part is not None and part.BIDIRECTIONAL_IMAGES


def merge_images(lw: Lowerer) -> None:
    """The image soft tokens in place of their placeholder tokens, after the embedding (its scale
    included, as HF merges them) leaves ``h`` whole on every device: ``h * mm_keep + mm_embeds``,
    both host-made per step (``device.image_inputs``: 0 / the soft token at an image token's row,
    1 / 0 at a text token's), so every bucket keeps one forward and one trace."""
    h = lw.shapes["h"]
    if h[3] != lw.dims.hidden_size:
        raise NotImplementedError(f"the embedding leaves h split ({h[3]} of {lw.dims.hidden_size} features per "
                                  "device); merging image soft tokens needs it whole")
    lw.op = "merge_images"
    lw.call("multiply", T("h"), T("mm_keep"), out="h", shape=h, memory_config=DRAM)
    lw.call("add", T("h"), T("mm_embeds"), out="h", shape=h, memory_config=DRAM)


def static_prefill_start(program) -> bool:
    """Does this program's prefill attention take its chunk start as a static int (MLA, as its
    traits record)?"""
    return program.traits.mla is not None


def chunk_starts(package, program) -> list[int]:
    """The chunk starts ``program``'s forward must be lowered for: ``[0]`` unless the start is
    static (MLA prefill), then every multiple of the prefill chunk (``package.buckets``, the
    manifest's) below max_model_len for a bucket that can hold a chunk (the scheduler starts
    chunks only there)."""
    bucket = program.bucket
    if program.phase != "prefill" or not static_prefill_start(program):
        return [0]
    b = package.buckets
    chunk = b.prefill_chunk or max(b.prefill)
    if bucket > chunk:
        return [0]
    return list(range(0, program.dims.max_model_len, chunk))


def static_start(package, program, start: int) -> int:
    """The start part of a forward key for a chunk at ``start`` of ``program`` (``package``: its
    ``buckets``, a ``LoadedPackage``)."""
    starts = chunk_starts(package, program)
    if starts == [0]:
        return 0
    if start not in starts:
        raise ValueError(f"prefill chunk at position {start}: chunks start at multiples of "
                         f"{starts[1] if len(starts) > 1 else 'the prefill chunk'}")
    return start
