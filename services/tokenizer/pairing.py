"""Which prefill engine can hand its KV over to which decode engine (docs/design/
disaggregation.md, "Tensor parallelism"), decided by the frontend from their EngineReady.

A decode engine pulls a prefill engine's leased blocks into its prefix cache, so the two must
lay out the same KV: one model (its KV heads), one block size, and a prefix cache on the decode
side (without one its scheduler recomputes every hand-over: "unusable"). Tensor-parallel sizes
may differ: the decode ranks re-shard (services/worker/kv_shards.py) whenever the model's KV
heads split over both sizes, which each engine checked for its own size at start; two engines
of one model therefore always pair, and the sizes are logged (re-sharded or not). A pairing
that cannot hand over is logged when the second of the two becomes ready, and the router
sends no hand-over along it (engines.py): a prompt goes to a prefill engine only while a
decode engine it pairs with is ready, and a handed-over request only to such a decode engine
(none ready: it is recomputed on another, as without a hand-over).
"""

from __future__ import annotations

from typing import Optional

from shared.protocol.engine_channel import EngineReady


def pairing_problem(prefill: EngineReady, decode: EngineReady) -> Optional[str]:
    """Why `decode` cannot take `prefill`'s hand-overs (None: it can)."""
    if not prefill.kv_endpoint:
        return "the prefill engine serves no KV (no kv_endpoint)"
    if prefill.model_name != decode.model_name:
        return f"different models ({prefill.model_name} and {decode.model_name})"
    if prefill.block_size != decode.block_size:
        return f"different block sizes ({prefill.block_size} and {decode.block_size})"
    if not decode.prefix_caching:
        return "the decode engine keeps no prefix cache to take the blocks into"
    return None


def pairing_fields(prefill: EngineReady, decode: EngineReady) -> dict[str, object]:
    """What a log line says of a pairing: both tensor-parallel sizes and whether the KV is
    re-sharded on the way (None: an engine that does not report its size, an older one)."""
    sizes = (prefill.tensor_parallel_size, decode.tensor_parallel_size)
    resharded = None if None in sizes else sizes[0] != sizes[1]
    return {"prefill_tp": sizes[0], "decode_tp": sizes[1], "resharded": resharded}
