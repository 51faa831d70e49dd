"""What the Helios session tests share: the compiled, patched session driven through every command
(``compiled_session_run``) and the chunk-by-chunk error against stock (``assert_chunks_match``)."""
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter  # counts the graphs dynamo compiles, runs them eagerly

import diffusers_nki
from diffusers_nki import ops


def compiled_session_run(pipe, make_session, chunks: int, new_prompt_embeds, image):
    """Patch ``pipe`` (torch backend, strict), compile its transformer with a counting backend, and run a session
    from ``make_session(pipe)``: ``warmup()``, ``chunks`` chunks, a prompt switch and a chunk, a reset (seed 1) with
    ``image`` and two chunks. Unpatches after. Returns (graphs after warm-up, graphs at the end, the first
    ``chunks`` chunks' latents, attention calls routed through our op)."""
    diffusers_nki.patch(pipe, backend="torch", strict=True)
    counter = CompileCounter()
    try:
        before = ops.counters()["attention"]["torch"]
        pipe.transformer.compile(backend=counter, dynamic=False, fullgraph=True)
        s = make_session(pipe)
        s.warmup()
        warm = counter.frame_count
        out = [s.next_chunk().latents for _ in range(chunks)]
        s.set_prompt(prompt_embeds=new_prompt_embeds)
        s.next_chunk()
        s.reset(seed=1)
        s.set_image(image)
        s.next_chunk()  # chunk 0 of a new video, with an image
        s.next_chunk()
        routed = ops.counters()["attention"]["torch"] - before
    finally:
        pipe.transformer._compiled_call_impl = None
        torch._dynamo.reset()
        diffusers_nki.unpatch(pipe)
    return warm, counter.frame_count, out, routed


def assert_chunks_match(out, ref, tol: float = 1e-5):
    """Every chunk's max error relative to the stock chunk's largest value within ``tol``."""
    for c, (o, r) in enumerate(zip(out, ref)):
        err = float((o - r).abs().max() / r.abs().max())
        assert err <= tol, (c, err)
