"""Writes the Parquet twins of crates/r3-tasks/tests/data/verl_rows.jsonl with pyarrow, as
verl's preprocessing scripts do (pandas / pyarrow): one snappy-compressed (pyarrow's default)
and one zstd-compressed file. r3-tasks' dataset test checks both load to the JSONL's rows.

Run from the repository root:  python3 scripts/data-fixtures/make_parquet_fixture.py
Needs: pip install pyarrow
"""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

DATA = pathlib.Path("crates/r3-tasks/tests/data")


def main() -> None:
    rows = [json.loads(line) for line in (DATA / "verl_rows.jsonl").read_text().splitlines() if line.strip()]
    table = pa.Table.from_pylist(rows)
    for codec in ["snappy", "zstd"]:
        out = DATA / f"verl_rows.{codec}.parquet"
        pq.write_table(table, out, compression=codec)
        print(out, out.stat().st_size, "bytes", table.schema)


if __name__ == "__main__":
    main()
