"""LongLive 2.0 (NVlabs/LongLive HEAD: Wan2.2-TI2V-5B geometry) at the TRANSFORMER level: their own causal model
(``wan_5b/modules/causal_model.py`` ``CausalWanModel``, loaded by their own ``WanDiffusionWrapper`` through
``from_pretrained``, called through the wrapper with their KV-cache dicts) against the stock diffusers
``WanTransformer3DModel`` with the same weights converted by ``convert_causal_wan_checkpoint``: 48 latent channels,
per-frame timesteps (theirs ``[B, F]``, the image-to-video first frame at t = 0) given to diffusers per token
(``[B, F * tokens_per_frame]``, Wan2.2's expanded timesteps), one chunk on an empty cache, fp32.

Their whole rollout (UniPC per chunk, the shot sink pinned at a scene cut, the RoPE offset per shot, image-to-video)
through CausalWanPipeline against their inference loop: tests/pipelines/test_longlive2_pipeline_original.py. The
harness (``causal_forcing_original.py``) changes in
their code what it changes for Causal Forcing, plus: their Triton RoPE / adaLN kernels off (``LLV2_TRITON_ROPE=0``,
``LLV2_TRITON_ADALN=0``, their own switches; the fp64 complex RoPE runs), and an unused import of a name newer
transformers no longer has (``x_clip_loss``) answered with ``None`` while their modules import."""
import functools
import os
import sys

import pytest
import torch
from diffusers import WanTransformer3DModel

from diffusers_nki.cache import StaticCacheConfig, apply_static_cache
from diffusers_nki.caching.causal_wan import CHUNK_KEY, CausalChunk
from diffusers_nki.pipelines import convert_causal_wan_checkpoint
from diffusers_nki.testing.tiny.originals import LONGLIVE2_ORIGINAL, longlive2_diffusers_config

sys.path.insert(0, os.path.dirname(__file__))
import causal_forcing_original as cfo  # noqa: E402

REPO = "NVlabs/LongLive"
H = W = 4  # latent grid (tokens per frame: 4)


@pytest.fixture(scope="module")
def their(tmp_path_factory):
    git = cfo.source(REPO)
    if git is None:
        pytest.skip(cfo.skip_reason(REPO))
    root = tmp_path_factory.mktemp("longlive2")
    commit = cfo.extract(git, root, paths=("utils", "wan_5b"))
    saved = {k: os.environ.get(k) for k in ("LLV2_TRITON_ROPE", "LLV2_TRITON_ADALN")}
    os.environ.update(LLV2_TRITON_ROPE="0", LLV2_TRITON_ADALN="0")  # read by their modules at import
    import transformers.models.x_clip.modeling_x_clip as xclip

    had = hasattr(xclip, "x_clip_loss")
    if not had:
        xclip.x_clip_loss = None
    try:
        with cfo.their_modules(root, packages=("wan_5b",)):
            import utils.wan_5b_wrapper as wrapper
            import wan_5b.modules.attention as attention
            import wan_5b.modules.causal_model as causal_model
            import wan_5b.modules.model as model
    finally:
        if not had:
            del xclip.x_clip_loss
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    fp32 = functools.partial(attention.attention, dtype=torch.float32)  # as for Causal Forcing: float32 on CPU
    causal_model.attention = causal_model.flash_attention = model.flash_attention = fp32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tiny = causal_model.CausalWanModel(**LONGLIVE2_ORIGINAL)
        for p in tiny.parameters():
            p.data.normal_(0.0, 0.3 if p.ndim < 2 else 0.1)
    tiny.save_pretrained(str(root / "wan_models" / "Tiny5B"))

    def make(local_attn_size, sink_size, num_frame_per_block=2):
        cwd = os.getcwd()
        os.chdir(root)
        try:  # their loader: CausalWanModel.from_pretrained("wan_models/<model_name>/") inside their wrapper
            return wrapper.WanDiffusionWrapper(model_name="Tiny5B", timestep_shift=5.0, is_causal=True,
                                               local_attn_size=local_attn_size, sink_size=sink_size,
                                               num_frame_per_block=num_frame_per_block)
        finally:
            os.chdir(cwd)

    return dict(make=make, wrapper=make(32, 8), commit=commit,
                state={f"model.{k}": v for k, v in tiny.state_dict().items()})


def _ours(their, **cache):
    model = WanTransformer3DModel(**longlive2_diffusers_config()).eval()
    convert_causal_wan_checkpoint({"generator": their["state"]}, transformer=model)
    if cache:
        apply_static_cache(model, StaticCacheConfig(rolling=True, backend="torch", **cache), families=("causal_wan",))
    return model


def _their_caches(model, batch, frames_window, tokens):
    heads, head_dim = model.num_heads, model.dim // model.num_heads
    kv = [{"k": torch.zeros(batch, frames_window * tokens, heads, head_dim),
           "v": torch.zeros(batch, frames_window * tokens, heads, head_dim), "quantized": False,
           "block_token_size": 2 * tokens, "max_blocks": frames_window // 2, "num_heads": heads,
           "num_filled_blocks": 0, "global_end_index": torch.tensor([0]), "local_end_index": torch.tensor([0]),
           "pinned_start": torch.tensor([-1]), "pinned_len": torch.tensor([0])} for _ in range(model.num_layers)]
    cross = [{"k": torch.zeros(batch, 512, heads, head_dim), "v": torch.zeros(batch, 512, heads, head_dim),
              "is_init": False} for _ in range(model.num_layers)]
    return kv, cross


@pytest.mark.parametrize("timesteps", [(0.0, 750.0), (500.0, 500.0)], ids=["i2v_first_frame_clean", "uniform"])
def test_longlive2_transformer_with_per_frame_timesteps_equals_diffusers_per_token(their, timesteps):
    g = torch.Generator().manual_seed(3)
    F = len(timesteps)
    x = torch.randn(1, F, LONGLIVE2_ORIGINAL["in_dim"], H, W, generator=g)  # theirs: [B, F, C, h, w]
    pe = cfo.pad_text(torch.randn(1, 9, LONGLIVE2_ORIGINAL["text_dim"], generator=g) * 0.1)
    t = torch.tensor([timesteps])
    tokens = H * W // 4
    w = their["wrapper"]
    kv, cross = _their_caches(w.model, 1, 32, tokens)
    with torch.no_grad():
        flow, _ = w(noisy_image_or_video=x, conditional_dict={"prompt_embeds": pe}, timestep=t, kv_cache=kv,
                    crossattn_cache=cross, current_start=0, cache_start=0)
        ours_model = _ours(their)
        ours = ours_model(hidden_states=x.permute(0, 2, 1, 3, 4), timestep=t.repeat_interleave(tokens, dim=1),
                          encoder_hidden_states=pe, return_dict=False)[0]
    ref = flow.permute(0, 2, 1, 3, 4)
    err = float((ours - ref).abs().max() / ref.abs().max())
    print(f"longlive 2.0 transformer {timesteps}: max rel err {err:.2e}")
    assert err <= 1e-5, (their["commit"], err)
    if timesteps[0] != timesteps[1]:  # the per-token timesteps matter: one timestep for the chunk is another output
        with torch.no_grad():
            one = ours_model(hidden_states=x.permute(0, 2, 1, 3, 4), timestep=torch.tensor([timesteps[1]]),
                             encoder_hidden_states=pe, return_dict=False)[0]
        assert float((one - ref).abs().max() / ref.abs().max()) > 1e-2


def test_longlive2_rollout_through_the_static_cache_equals_their_kv_cache(their):
    # chunks of 2 latent frames, a 6-frame window with a 2-frame sink (their local_attn_size / sink_size; the
    # published 32 / 8 / chunks of 8 scaled down so that 6 chunks roll the window), per-frame timesteps given per
    # token; per chunk a denoising pass (compared) and a cache pass over clean latents at t = 0, the same inputs
    # on both sides: our static cache (diffusers_nki.caching.causal_wan) against their KV cache, chunk by chunk
    block, window, sink, tokens = 2, 6, 2, H * W // 4
    w = their["make"](window, sink)
    kv, cross = _their_caches(w.model, 1, window, tokens)
    ours = _ours(their, capacity=window, sink=sink)
    no_sink = _ours(their, capacity=window, sink=0)  # the comparison can fail: a cache without the sink
    g = torch.Generator().manual_seed(5)
    pe = cfo.pad_text(torch.randn(1, 9, LONGLIVE2_ORIGINAL["text_dim"], generator=g) * 0.1)
    errs, off = [], []
    with torch.no_grad():
        for c in range(6):
            x = torch.randn(1, block, LONGLIVE2_ORIGINAL["in_dim"], H, W, generator=g)
            clean = torch.randn(1, block, LONGLIVE2_ORIGINAL["in_dim"], H, W, generator=g)
            t = torch.tensor([[0.0 if c == 0 else 750.0, 750.0]])  # image-to-video: the first frame clean
            start = c * block * tokens
            flow, _ = w(noisy_image_or_video=x, conditional_dict={"prompt_embeds": pe}, timestep=t, kv_cache=kv,
                        crossattn_cache=cross, current_start=start, cache_start=start)
            ref = flow.permute(0, 2, 1, 3, 4)
            z = torch.zeros(1, block)
            w(noisy_image_or_video=clean, conditional_dict={"prompt_embeds": pe}, timestep=z, kv_cache=kv,
              crossattn_cache=cross, current_start=start, cache_start=start)
            for model, out in ((ours, errs), (no_sink, off)):
                got = model(hidden_states=x.permute(0, 2, 1, 3, 4), timestep=t.repeat_interleave(tokens, dim=1),
                            encoder_hidden_states=pe, return_dict=False,
                            attention_kwargs={CHUNK_KEY: CausalChunk(start_frame=c * block, block_frames=block)})[0]
                out.append(float((got - ref).abs().max() / ref.abs().max()))
                model(hidden_states=clean.permute(0, 2, 1, 3, 4), timestep=z.repeat_interleave(tokens, dim=1),
                      encoder_hidden_states=pe, return_dict=False,
                      attention_kwargs={CHUNK_KEY: CausalChunk(start_frame=c * block, block_frames=block,
                                                               commit=True)})
    print(f"longlive 2.0 rollout through the static cache: max rel err per chunk {errs}")
    assert max(errs) <= 1e-5, (their["commit"], errs)
    assert max(off[:3]) <= 1e-5 and min(off[3:]) > 1e-3, off  # equal until the window rolls, then not


def test_per_token_timesteps_through_the_static_cache_without_the_mirror():
    # (no original needed) chunk 0 on an empty cache is the stock forward: the per-token timesteps path of the
    # causal Wan static cache equals diffusers' own Wan2.2 path, and a timestep of another shape is refused by name
    torch.manual_seed(0)
    model = WanTransformer3DModel(**longlive2_diffusers_config()).eval()
    for p in model.parameters():
        p.data.normal_(0.0, 0.3 if p.ndim < 2 else 0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 48, 2, H, W, generator=g)
    pe = torch.randn(1, 512, LONGLIVE2_ORIGINAL["text_dim"], generator=g) * 0.1
    t = torch.tensor([[0.0] * 4 + [750.0] * 4])
    with torch.no_grad():
        stock = model(hidden_states=x, timestep=t, encoder_hidden_states=pe, return_dict=False)[0]
        apply_static_cache(model, StaticCacheConfig(capacity=6, sink=2, rolling=True, backend="torch"),
                           families=("causal_wan",))
        cached = model(hidden_states=x, timestep=t, encoder_hidden_states=pe, return_dict=False,
                       attention_kwargs={CHUNK_KEY: CausalChunk(start_frame=0, block_frames=2)})[0]
        err = float((cached - stock).abs().max() / stock.abs().max())
        assert err <= 1e-6, err
        with pytest.raises(NotImplementedError, match=r"timestep of shape \(1, 5\); one timestep per batch row "
                                                      r"\(\[B\]\) or one per token of the call \(\[B, 8\]\)"):
            model(hidden_states=x, timestep=t[:, :5], encoder_hidden_states=pe, return_dict=False,
                  attention_kwargs={CHUNK_KEY: CausalChunk(start_frame=0, block_frames=2)})


def test_per_token_timesteps_keep_one_compiled_graph_per_call_site():
    # the blocks compiled (counting backend): per-token modulation has the same shape at every chunk, so after the
    # first chunk (a denoising pass and a cache pass) no chunk compiles a graph, through the window's roll
    import torch._dynamo

    from torch._dynamo.testing import CompileCounter  # counts the graphs dynamo compiles, runs them eagerly

    torch.manual_seed(0)
    model = WanTransformer3DModel(**longlive2_diffusers_config()).eval()
    apply_static_cache(model, StaticCacheConfig(capacity=6, sink=2, rolling=True, backend="torch"),
                       families=("causal_wan",))
    counter = CompileCounter()
    g = torch.Generator().manual_seed(2)
    pe = torch.randn(1, 512, LONGLIVE2_ORIGINAL["text_dim"], generator=g) * 0.1
    marks = []
    try:
        model.compile_repeated_blocks(backend=counter, dynamic=False)
        with torch.no_grad():
            for c in range(6):
                x = torch.randn(1, 48, 2, H, W, generator=g)
                for commit, t in ((False, 750.0), (True, 0.0)):
                    ts = torch.full((1, 2 * H * W // 4), t)
                    model(hidden_states=x, timestep=ts, encoder_hidden_states=pe, return_dict=False,
                          attention_kwargs={CHUNK_KEY: CausalChunk(start_frame=2 * c, block_frames=2, commit=commit)})
                marks.append(counter.frame_count)
    finally:
        for block in model.blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
    assert marks[0] >= 1 and marks[-1] == marks[0], marks
