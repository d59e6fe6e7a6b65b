"""Run by tests/tt/test_feed_ttnn.py in its own process (one mock cluster per process): the decode
token feed (``backends/ttnn/feed``) through ttnn's op validation on a mock mesh.

    python feed_mockcheck.py MOCK_MESH SPEC LOWERED_FOR...

For each mesh in LOWERED_FOR, SPEC's smallest decode program (each layer kind once) is lowered
for that mesh with device sampling; on the mock MOCK_MESH, ttnn validates (``mockcheck.validate``)
the whole forward when it is the same mesh, and always the forward made of its feed calls alone
(the calls a program's lowering marks ``feed.OP``, their inputs at the shapes the forward
declares, ``next_tokens`` as ``ttnn.sampling`` writes it: uint32 ROW_MAJOR). Then two broken
feeds, which ttnn must refuse: an index of another rank than the gathered tensor, and a copy into
ids of another shape. One ``RESULT {json}`` line per check.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import ttnn
import yaml

from ttbundle import lower as lowermod, mesh as meshmod, spec as specmod
from ttbundle.plan.make import make_plan
from ttbundle.backends.ttnn import feed, mockcheck
from ttbundle.backends.ttnn.calls import Forward, Layer
from ttbundle.backends.ttnn.lowering import lower_forward


def feed_only(fw: Forward, ir) -> Forward:
    """The feed calls of ``fw`` as a forward of their own: inputs tokens, feed_rows and
    next_tokens (the sampling output they copy), the feed's state."""
    calls = [c for _, c in fw.calls() if c.op == feed.OP]
    R = fw.rows
    inputs = {"tokens": fw.inputs["tokens"], feed.FEED_INPUT: fw.inputs[feed.FEED_INPUT],
              "next_tokens": ((1, 1, 1, R), "uint32", "ROW_MAJOR")}
    return Forward("decode", fw.bucket, R, inputs, [Layer("feed", None, calls)], ["next_tokens"],
                   state=dict(fw.state))


def result(name: str, r, fw: Forward) -> None:
    print("RESULT " + json.dumps({"case": name, "calls": r.calls, "fns": [c.fn for _, c in fw.calls()],
                                  "feed_fns": [c.fn for _, c in fw.calls() if c.op == feed.OP],
                                  "accepted": sum(r.accepted.values()), "by_signature": dict(r.by_signature),
                                  "refused_calls": sum(r.refusals.values()),
                                  "refused": {fn: list(v) for fn, v in r.refused.items()}}), flush=True)


def main() -> int:
    mock, spec_path, targets = sys.argv[1], sys.argv[2], sys.argv[3:]
    device = mockcheck.open_mesh(ttnn, meshmod.resolve(mock))
    grid = mockcheck.worker_grid(device)
    try:
        for target in targets:
            d = yaml.safe_load(open(spec_path))
            d["targets"] = [target]
            d.get("weights", {}).pop("source", None)
            bundle = specmod.loads(yaml.safe_dump(d), spec_path)
            plan = make_plan(bundle, target)
            ts = lowermod.trace_set(bundle)
            ir = lowermod.lower(bundle, plan, *min(k for k in ts if k[0] == "decode"))
            ir = dataclasses.replace(ir, layers=tuple(dataclasses.replace(lp, count=1) for lp in ir.layers))
            fw = lower_forward(bundle, plan.mesh, ir, "device", grid=grid if target == mock else None)
            if target == mock:
                result(f"{target}:forward", mockcheck.validate(ttnn, device, ir, fw), fw)
            ff = feed_only(fw, ir)
            result(f"{target}:feed", mockcheck.validate(ttnn, device, ir, ff), ff)
        # broken feeds: ttnn must refuse them (the validation is not vacuous)
        R = ff.rows
        bad_rank = dataclasses.replace(ff, inputs={**ff.inputs, feed.FEED_INPUT: ((1, 1, R), "uint32", "ROW_MAJOR")})
        result("bad:index_rank", mockcheck.validate(ttnn, device, ir, bad_rank), bad_rank)
        ids = feed.feed_ids(R)
        bad_copy = dataclasses.replace(ff, layers=[Layer("feed", None, [c for _, c in ff.calls() if c.fn == "copy"])],
                                       state={ids: ((1, 1, 1, 2 * R), "uint32", "ROW_MAJOR")})
        result("bad:copy_shape", mockcheck.validate(ttnn, device, ir, bad_copy), bad_copy)
    finally:
        ttnn.close_mesh_device(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
