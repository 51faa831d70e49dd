"""Inputs shared by the context-parallel workers and the single-process references (same seeds, same calls)."""
from diffusers_nki.tiny import tiny_call_kwargs

# 5 chunks of 1-2 frames (padded to 2-frame slots), 64x64 px: 16 full / 4 compressed tokens per frame (divisible
# by 4 ranks); 3 chunks get compressed, the cache holds the whole video (parity with unbounded history)
ANYFLOW_FAR_PARTITION = [1, 2, 1, 2, 1]
ANYFLOW_FAR_CACHE = dict(capacity=sum(ANYFLOW_FAR_PARTITION) + 1, chunk_frames=2)


def anyflow_far_kwargs():
    kw = tiny_call_kwargs("anyflow_far", chunks=3, steps=2, seed=0, output_type="latent")
    cp = ANYFLOW_FAR_PARTITION
    # guidance 3: the transformer runs cond + uncond as batch 2 (per-batch key lengths under the shards)
    kw.update(num_frames=4 * (sum(cp) - 1) + 1, chunk_partition=list(cp), height=64, width=64, guidance_scale=3.0)
    return kw


def wan_inputs(make):
    return make(2)  # batch 2, 2 latent frames of 16x16: 128 tokens (divisible by 4 ranks), 12 text tokens
