"""Host-side prefix trees: trie, DFS orders and the segment plan (numpy; no JAX)."""

from dtarl.tree.order import DFSOrder, child_order, dfs_preorder, order_cost
from dtarl.tree.plan import Op, SegmentPlan, bucket, compile_plan
from dtarl.tree.trie import PrefixTree, TreeStats, build_tree, lcp, sort_key

__all__ = [
    "DFSOrder",
    "Op",
    "PrefixTree",
    "SegmentPlan",
    "TreeStats",
    "bucket",
    "build_tree",
    "child_order",
    "compile_plan",
    "dfs_preorder",
    "lcp",
    "order_cost",
    "sort_key",
]
