"""The vision encoders' emulated kernels, one module per encoder named after its family
(``vision/<family name>.py``: ``gemma3``, ``qwen2_5_vl``, ``qwen3_vl``, ``mistral3``), each with
its kernels in ``KERNELS``; ``_common`` holds what several share (its ``KERNELS``: the kernels
more than one encoder's program names). A new encoder is a new module here, registered in
``kernel_table.KERNELS`` (its ``ENCODERS``): one line; ``tests/test_vision_encoders.py`` keeps each
encoder's kernels in its own module.
"""
