"""Internal column names and bit layouts, in one place (driver and executors share them).

Packed DataFrames hold only these columns (user columns travel inside the blobs), so they can
never collide with user column names. Output columns get positional internal names and are
renamed to the user's names (duplicates allowed, as in Spark) by the driver.
"""
BLOCK_ID = "__nj_block_id"
BLOB = "__nj_blob"
Q_BLOCK_ID = "__nj_q_block_id"
Q_BLOB = "__nj_q_blob"
T_BLOCK_ID = "__nj_t_block_id"
T_BLOB = "__nj_t_blob"
FIRST_ROW = "__nj_first_row"   # a task's first streamed row (nearest_join.join._first_row_meets)
PARTIAL = "__nj_partial"
# on= keys: a side's key columns cast to their common type, and the dense group id of a key.
GROUP = "__nj_group"
# The keyed blocked plan (nearest_join.keyed): a row's cell, and the row ids that order a
# cell's rows (each query part's rows in the same order in every cell it is in).
CELL = "__nj_cell"
Q_ROW = "__nj_q_row"
T_ROW = "__nj_t_row"
# A query row's rank among its groups (an IVF query's probed lists, nearest first; 0 for a
# query of one group): the row of rank 0 carries the query's payload to stage 2.
PROBE = "__nj_probe"
# The output's target columns packed in one struct, unpacked under the target's alias
# (nearest_join.join: the output keeps the sides' qualifiers).
TARGET_STRUCT = "__nj_target"
# The local plan's output (nearest_join.join): one row per query row, its matches' other
# columns in an array of structs.
MATCHES = "__nj_matches"


def key_name(position: int) -> str:
    """Internal name of key ``position`` of ``on=`` (cast to the common type)."""
    return f"__nj_key_{position}"

# Inside a partial blob: per (query row, rank) slot.
SLOT_VALUE = "__nj_value"
SLOT_KEY = "__nj_key"
SLOT_ROW = "__nj_payload_row"   # row of the partial's payload table, -1 = empty slot
SLOT_QUERY = "__nj_query_row"  # the query row id (C.Q_ROW) of the slot's row, when shipped

# block_id = partition << PARTITION_SHIFT | sequence number within the partition's task.
# A target row's global key = block_id << ROW_BITS | row within the block: it orders target
# rows for the tie rule (lower key wins) and fits in int64: 19 + 20 + 24 = 63 bits.
PARTITION_BITS = 19
SEQUENCE_BITS = 20
ROW_BITS = 24
MAX_BLOCK_ROWS = (1 << ROW_BITS) - 1
EMPTY_BLOCK_ID = -1  # the always-present empty target block (LEFT OUTER with no targets)


def output_name(position: int) -> str:
    """Positional internal name of output column ``position``."""
    return f"__nj_out_{position}"
