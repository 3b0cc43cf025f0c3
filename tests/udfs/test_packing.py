"""udfs.packing: a side's rows cut into blocks, each one Arrow IPC blob that holds all their
columns."""
import numpy as np
import pyarrow as pa

from udfs import columns as C
from udfs.context import SideLayout
from udfs.decode import blob_to_table
from udfs.packing import pack_blocks


def test_pack_blocks_sizes_ids_and_round_trip():
    rng = np.random.default_rng(2)
    T = rng.standard_normal((25, 3)).astype(np.float32)
    tt = pa.table({"tid": np.arange(25), "tag": [f"t{i}" for i in range(25)],
                   "tv": pa.array(list(T), type=pa.list_(pa.float32()))})
    packed = list(pack_blocks(tt.to_batches(max_chunksize=7), SideLayout("tv", 2, 3, 10), partition=3))
    ids = [b.column(0)[0].as_py() for b in packed]
    assert ids == [(3 << C.SEQUENCE_BITS) | s for s in range(3)]
    tables = [blob_to_table(b.column(1)[0].as_py()) for b in packed]
    assert [t.num_rows for t in tables] == [10, 10, 5]
    assert pa.concat_tables(tables).equals(tt)
