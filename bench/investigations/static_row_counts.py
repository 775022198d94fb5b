"""Host time of the row-count bookkeeping after a graphed decode or verify step: every compressed stream of every
sequence gets its row count from the sequence's new length (`SequenceState.advance`), against the loop it replaced
(a `getattr` chain per stream per sequence). At V4-Flash's depth by default: 43 layers alternating CSA (a
compressor and an indexer, ratio 4) and HCA (ratio 128), 256 sequences.

    python bench/investigations/static_row_counts.py [--layers 43] [--batch 256] [--repeats 200]

The row stores are stand-ins holding only `num_rows` (what both versions write); the states are real
`SequenceState`s. Prints milliseconds a step for each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import timeit
from types import SimpleNamespace

from deepserve.model.state import SequenceState


def make(layers: int, batch: int):
    streams = [(i, "compressor", 4 if i % 2 == 0 else 128) for i in range(layers)] + \
              [(i, "indexer", 4) for i in range(0, layers, 2)]

    def layer(i):
        rows = lambda: SimpleNamespace(rows=SimpleNamespace(num_rows=0))  # noqa: E731
        return SimpleNamespace(compressor=rows(), indexer=rows() if i % 2 == 0 else None)

    states = [SequenceState(layers=[layer(i) for i in range(layers)]) for _ in range(batch)]
    return streams, states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    streams, states = make(args.layers, args.batch)
    ends = [1000 + i for i in range(args.batch)]

    def loop():  # the loop before `advance`
        for end, st in zip(ends, states):
            for layer, name, ratio in streams:
                getattr(st.layers[layer], name).rows.num_rows = end // ratio
            st.num_tokens = end

    def advance():
        for end, st in zip(ends, states):
            st.advance(end, streams)

    advance()
    after = [getattr(st.layers[layer], name).rows.num_rows for st in states for layer, name, _ in streams]
    loop()
    assert after == [getattr(st.layers[layer], name).rows.num_rows for st in states for layer, name, _ in streams]
    res = {"streams": len(streams), "batch": args.batch}
    for name, fn in (("loop", loop), ("advance", advance)):
        res[f"{name}_ms"] = min(timeit.repeat(fn, number=args.repeats // 10, repeat=10)) / (args.repeats // 10) * 1e3
    res["speedup"] = res["loop_ms"] / res["advance_ms"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
