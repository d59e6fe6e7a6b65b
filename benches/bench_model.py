"""The project's benchmark model, defined once for every bench: a ~160M-parameter Llama
(hidden 1024, 8 layers, 16 heads, 8 KV heads, intermediate 2816, vocab 32000), random weights."""

SPEC = """
name: bench-160m
description: ttbundle benchmark model (random weights)
model:
  family: llama
  vocab_size: 32000
  hidden_size: 1024
  intermediate_size: 2816
  num_hidden_layers: 8
  num_attention_heads: 16
  num_key_value_heads: 8
  max_position_embeddings: 2048
targets: [N150, T3K]
buckets: {prefill: [128, 512], decode: [1, 8, 16, 32], prefill_chunk: 512}
runtime: {max_model_len: 1024, max_num_seqs: 32}
"""
