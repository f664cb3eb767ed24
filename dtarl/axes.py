"""The logical axis vocabulary of dtarl parameters and activations.

Every parameter carries a tuple of these names in its ``axes`` metadata; a rule
table per mesh (``dtarl.parallel``) maps them to mesh axes. Keep the list small.

    batch     sequences in a batch
    seq       query tokens
    kv_seq    key/value tokens (prefix + chunk)
    embed     model width (hidden size)
    heads     query heads
    kv_heads  key/value heads
    head_dim  per-head width
    mlp       feed-forward hidden width
    vocab     vocabulary
    layers    stacked decoder layers
"""

BATCH = "batch"
SEQ = "seq"
KV_SEQ = "kv_seq"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LAYERS = "layers"

ALL = (BATCH, SEQ, KV_SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS)
