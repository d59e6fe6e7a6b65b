"""The vision encoders' ttnn lowerings, one module per encoder named after its family
(``vision/<family name>.py``: ``gemma3``, ``qwen2_5_vl``, ``qwen3_vl``, ``mistral3``), each with
its op lowerings in ``OPS``; ``_common`` holds what several share (its ``OPS``: the op lowerings
more than one encoder's program names). A new encoder is a new module here, registered in
``lowering.OPS`` (its ``ENCODERS``): one line; ``tests/test_vision_encoders.py`` keeps each
encoder's op lowerings in its own module.
"""
