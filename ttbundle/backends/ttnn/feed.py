"""The decode token feed on the device: a step's sampled ids into the next decode's token input.

Async decode and several tokens a step (``runtime.output_tokens_per_step``) submit decode N+1
before decode N's sampled ids are on the host, so N+1's rows must take their input token from
N's output on the device. The emulated mesh does it with a gather on its "device" tensors
(``runtime/adapter.BundleModel.decode_forward``: ``where(take, prev[rows], tokens)``); here the
same gather is part of every device-sampled decode forward, so it is inside the decode trace:

* **state** ``feed.ids.r{R}`` (``Forward.state``: one persistent tensor per runner, that is per mesh
  or lane submesh, zero-filled when it prepares): the last device-sampled decode's ids,
  ``[1, 1, 1, R]`` uint32 ROW_MAJOR (what ``ttnn.sampling`` writes);
* **input** ``feed_rows`` ``[1, 1, 1, R]`` uint32: for row ``i``, ``i`` (keep the token the host
  wrote) or ``R + j`` (row ``j`` of ``feed.ids``);
* at the start: ``concat([tokens, feed.ids], 3)`` then ``gather(.., 3, feed_rows)``: the token
  row the embedding reads (``tokens.fed``);
* at the end: ``copy(next_tokens, feed.ids)``: this step's ids for the next one (device order:
  the next decode's gather runs after this copy; the readback of ``next_tokens`` is separate).

The host passes :func:`feed_index` each step (the identity map when nothing is fed, one array
reused so the input is not copied again). ``runtime/ttdevice.TTDeviceModel.decode_forward``
feeds only from the decode that last wrote ``feed.ids`` on that runner (tracked per runner); an
older output is read back and written from the host instead (a synchronous step, never wrong).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .calls import Attr, Call, Forward, New, T

FEED_IDS = "feed.ids"  # + ".r{rows}": one per decode row count (a gather reads the rows it was written with)
FEED_INPUT = "feed_rows"
FED_TOKENS = "tokens.fed"
OP = "token_feed"
_DRAM = Attr("DRAM_MEMORY_CONFIG")


def _swap(v, old: str, new: str):
    """``v`` with every ``T(old)`` replaced by ``T(new)`` (nested lists, tuples, constructors)."""
    if isinstance(v, T):
        return T(new) if v.name == old else v
    if isinstance(v, list):
        return [_swap(x, old, new) for x in v]
    if isinstance(v, tuple):
        return tuple(_swap(x, old, new) for x in v)
    if isinstance(v, New):
        return New(v.cls, _swap(v.args, old, new), tuple((k, _swap(x, old, new)) for k, x in v.kwargs), v.returns)
    return v


def add_feed(fw: Forward) -> Forward:
    """Device-sampled decode forward ``fw`` with the feed (module docstring): its calls read the
    fed tokens; the gather runs first, the copy of the sampled ids last."""
    if fw.phase != "decode" or "next_tokens" not in fw.outputs:
        raise ValueError(f"the token feed is for device-sampled decode forwards, not {fw.phase} -> {fw.outputs}")
    R = fw.rows
    if tuple(fw.inputs["tokens"][0]) != (1, R):
        raise ValueError(f"decode tokens input {fw.inputs['tokens'][0]} is not [1, {R}]")
    row = (1, 1, 1, R)
    ids = feed_ids(R)
    head = [
        Call("reshape", (T("tokens"), list(row)), out="feed.tok", shape=row, op=OP),
        Call("concat", ([T("feed.tok"), T(ids)], 3), (("memory_config", _DRAM),), out="feed.src",
             shape=(1, 1, 1, 2 * R), op=OP),
        Call("gather", (T("feed.src"), 3, T(FEED_INPUT)), (("memory_config", _DRAM),), out="feed.g", shape=row, op=OP),
        Call("reshape", (T("feed.g"), [1, R]), out=FED_TOKENS, shape=(1, R), op=OP),
    ]
    tail = [Call("copy", (T("next_tokens"), T(ids)), op=OP)]
    layers = []
    for i, layer in enumerate(fw.layers):
        calls = [dataclasses.replace(c, args=_swap(c.args, "tokens", FED_TOKENS),
                                     kwargs=_swap(c.kwargs, "tokens", FED_TOKENS)) for c in layer.calls]
        if i == 0:
            calls = head + calls
        if i == len(fw.layers) - 1:
            calls = calls + tail
        layers.append(dataclasses.replace(layer, calls=calls))
    inputs = {**fw.inputs, FEED_INPUT: (row, "uint32", "ROW_MAJOR")}
    state = {**fw.state, ids: (row, "uint32", "ROW_MAJOR")}
    return dataclasses.replace(fw, layers=layers, inputs=inputs, state=state)


def feed_ids(rows: int) -> str:
    """The state tensor holding the last sampled ids of the decodes of ``rows`` rows."""
    return f"{FEED_IDS}.r{rows}"


def has_feed(fw: Forward) -> bool:
    return feed_ids(fw.rows) in fw.state


_IDENTITY: dict = {}


def feed_index(R: int, rows=None):
    """The ``feed_rows`` input of a decode of ``R`` rows: row ``i`` keeps its written token
    (``i``) unless ``rows[i] >= 0`` (then ``R + rows[i]``: that row of the last sampled ids).
    ``rows`` None: the identity map, one array per ``R`` (so the input is written once)."""
    if rows is None:
        if R not in _IDENTITY:
            _IDENTITY[R] = np.arange(R, dtype=np.uint32).reshape(1, 1, 1, R)
        return _IDENTITY[R]
    r = np.full(R, -1, np.int64)
    given = np.asarray(rows, dtype=np.int64).reshape(-1)[:R]
    r[:given.size] = given
    if (r >= R).any():
        raise ValueError(f"feed rows {given.tolist()} point past the {R} rows of the last decode")
    return np.where(r >= 0, R + r, np.arange(R)).astype(np.uint32).reshape(1, 1, 1, R)


__all__ = ["FEED_IDS", "FEED_INPUT", "FED_TOKENS", "OP", "add_feed", "feed_ids", "feed_index", "has_feed"]
