"""Checks, with pyarrow as an independent reader, that every `<split>.parquet` in a dataset
directory holds exactly the rows of its `<split>.jsonl` twin (as `r3 data generate` writes them).

Usage:  python3 scripts/data-fixtures/check_parquet_twins.py data/gsm8k-style
Needs:  pip install pyarrow
"""

import json
import pathlib
import sys

import pyarrow.parquet as pq


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    failures = 0
    for parquet in sorted(root.glob("*.parquet")):
        rows = pq.read_table(parquet).to_pylist()
        jsonl = parquet.with_suffix(".jsonl")
        twins = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        bad = [i for i, (a, b) in enumerate(zip(rows, twins)) if a != b]
        ok = len(rows) == len(twins) and not bad
        failures += not ok
        print(f"{parquet}: {len(rows)} rows, {len(twins)} in {jsonl.name}, {len(bad)} differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
