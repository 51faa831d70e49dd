"""Token-generation attention: nki-library attention_tkg (flat and block KV cache, fused RoPE, in-kernel masks
from position ids, attention sink, LNC2) and gen_mask_tkg (through the library's own HBM entry point
gen_mask_tkg_hbm).

attention_tkg takes SBUF operands and an SBUF manager, so it is launched inside a wrapper kernel as its own test
launches it (an SbufManager over the usable SBUF less 16 KiB, outputs in SBUF or HBM as the configuration says,
q / k_active loaded into SBUF when ``qk_in_sb``). Inputs are built as that test builds them (uniform [0, 1)
tensors, the position ids ``(3b + 3 s_prior / 4) mod (s_prior - s_active)``, the mask from the library's
``build_full_attention_mask``, a block table of distinct blocks with the blocks past each sequence's end
zeroed); the reference is the library's torch twin ``attention_tkg_torch_ref[lnc]`` with the test's tolerance
(rtol 1e-2, atol 1e-5). The block-KV configuration reads its cache through ``.ap(scalar_offset=)`` on a
reshaped view: the regression check of the view-indexing fix (tests/sim/test_ap_views.py has the unit test)."""
from __future__ import annotations

import numpy as np

from . import Case
from ._util import BF16

LIB = "nki-library"
TKG = "nkilib.core.attention.attention_tkg"
UTILS = "nkilib.core.attention.attention_tkg_utils"


def _lib(module):
    from diffusers_nki_lab import production

    return production.import_module(LIB, module)


def _tkg_make(mod):
    from nkisim import isa as nisa
    from nkisim import language as nl

    alloc = _lib("nkilib.core.utils.allocator")
    logging = _lib("nkilib.core.utils.logging")

    def attention_tkg_launch(q, k_active, v_active, k_prior, v_prior, mask, inv_freqs, rope_pos_ids, start_pos_ids,
                             sink, active_blocks_table, attn_out_shape, k_out_shape, cfg, dtype):
        # our wrapper, doing what the library's test wrapper does around the kernel
        sbm = alloc.SbufManager(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, logging.Logger("SBM"))
        sbm.open_scope()
        if cfg.out_in_sb:
            out = sbm.alloc_stack(attn_out_shape, dtype=dtype, buffer=nl.sbuf)
        else:
            out = nl.ndarray(attn_out_shape, dtype=dtype, buffer=nl.shared_hbm)
        k_out = None
        if cfg.fuse_rope:
            if cfg.k_out_in_sb:
                k_out = sbm.alloc_stack(k_out_shape, dtype=dtype, buffer=nl.sbuf)
            else:
                k_out = nl.ndarray(k_out_shape, dtype=dtype, buffer=nl.shared_hbm)
        q_in, k_in = q, k_active
        if cfg.qk_in_sb:
            q_in = sbm.alloc_stack(q.shape, dtype=q.dtype, buffer=nl.sbuf)
            k_in = sbm.alloc_stack(k_active.shape, dtype=k_active.dtype, buffer=nl.sbuf)
            nisa.dma_copy(q_in, q)
            nisa.dma_copy(k_in, k_active)
        attn_out, k_out = mod.attention_tkg(q_in, k_in, v_active, k_prior, v_prior, mask, out, cfg, sbm, inv_freqs,
                                            rope_pos_ids, start_pos_ids, sink, active_blocks_table, k_out)
        if cfg.out_in_sb:
            hbm = nl.ndarray(attn_out.shape, dtype=attn_out.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=hbm, src=attn_out)
            attn_out = hbm
        if cfg.fuse_rope and cfg.k_out_in_sb:
            hbm = nl.ndarray(k_out.shape, dtype=k_out.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=hbm, src=k_out)
            k_out = hbm
        sbm.close_scope()
        if cfg.fuse_rope:
            return attn_out, k_out
        return attn_out

    return attention_tkg_launch


def _block_table(rng, bs, s_ctx, s_active, pos_id, block_len):
    n_blocks = bs * s_ctx // block_len
    arr = rng.choice(n_blocks, size=bs * (s_ctx // block_len), replace=False).reshape(bs, s_ctx // block_len)
    for b in range(bs):
        arr[b, -(-(int(pos_id[b, 0]) + s_active) // block_len):] = 0
    return arr.astype(np.uint32)


def _tkg(cfg_args, cfg_kw, lnc=1, sink=False):
    bs, qh, sa, sp, spf, d, bl = cfg_args

    def cfg():
        return _lib(UTILS).AttnTKGConfig(*cfg_args, **cfg_kw)

    def inputs(rng):
        import torch

        c = cfg()
        block = bl > 0

        def u(shape, dtype=BF16):
            return rng.random(shape).astype(np.float32).astype(dtype)

        q_shape = (d, bs * qh * sa) if c.qk_in_sb else (bs, qh, sa, d)
        ka_shape = (d, bs * sa) if c.qk_in_sb else (bs, 1, sa, d)
        if block:
            kp_shape = vp_shape = (bs * sp // bl, bl, d)
        else:
            kp_shape = (bs, 1, spf, d) if c.tp_k_prior else (bs, 1, d, spf)
            vp_shape = (bs, 1, spf, d)
        pos_id = ((np.arange(bs) * 3 + (sp // 4 * 3)) % (sp - sa))[:, None]
        if c.use_pos_id:
            m = torch.tril(torch.ones(sa, sa)).expand(bs, qh, sa, sa).permute(3, 0, 1, 2)
        else:
            gm = _lib("nkilib.core.attention.gen_mask_tkg_torch")
            m = gm.build_full_attention_mask(cache_lens=torch.from_numpy(pos_id.reshape(-1).astype(np.float32)),
                                             batch=bs, num_heads=qh, s_active=sa, s_ctx=sp, lnc=lnc, block_len=bl,
                                             include_active_mask=True, transposed=True,
                                             enable_fa_s_prior_tiling=c.enable_fa_s_prior_tiling)
        kw = {"q": u(q_shape), "k_active": u(ka_shape), "v_active": u((bs, 1, sa, d)), "k_prior": u(kp_shape),
              "v_prior": u(vp_shape), "mask": m.numpy().astype(np.bool_).astype(np.uint8),
              "inv_freqs": rng.random((d // 2, 1)).astype(np.float32) if c.fuse_rope else None,
              "rope_pos_ids": np.broadcast_to(pos_id, (bs, sa)).astype(np.float32)
              if (c.fuse_rope or c.use_pos_id) else None,
              "start_pos_ids": None,
              "sink": rng.random((qh, 1)).astype(np.float32) if sink else None,
              "active_blocks_table": _block_table(rng, bs, sp, sa, pos_id, bl) if block else None,
              "attn_out_shape": (d, bs * qh * sa) if c.out_in_sb else (bs, qh, d, sa),
              "k_out_shape": (d, bs * sa) if c.k_out_in_sb else (bs, 1, d, sa), "cfg": c, "dtype": _bf()}
        return kw

    def reference(mods, kw):
        import torch

        ref = mods("nkilib.core.attention.attention_tkg_torch").attention_tkg_torch_ref
        c = kw["cfg"]

        def t(a):
            if a is None:
                return None
            a = np.asarray(a)
            return torch.from_numpy(a.astype(np.float32) if a.dtype == BF16 else a.copy())

        out = torch.zeros(kw["attn_out_shape"], dtype=torch.float32)
        k_out = torch.zeros(kw["k_out_shape"], dtype=torch.float32) if c.fuse_rope else None
        o, ko = ref[lnc](q=t(kw["q"]), k_active=t(kw["k_active"]), v_active=t(kw["v_active"]),
                         k_prior=t(kw["k_prior"]), v_prior=t(kw["v_prior"]), mask=t(kw["mask"]), out=out, cfg=c,
                         sbm=None, inv_freqs=t(kw["inv_freqs"]), rope_pos_ids=t(kw["rope_pos_ids"]),
                         start_pos_ids=None, sink=t(kw["sink"]),
                         active_blocks_table=None if kw["active_blocks_table"] is None else
                         torch.from_numpy(kw["active_blocks_table"].astype(np.int64)), k_out=k_out, DBG_TENSORS=None)
        res = [o.double().numpy()]
        if c.fuse_rope:
            res.append(ko.double().numpy())
        return res

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=1e-5, rtol=1e-2, make=_tkg_make)


def _bf():
    from nkisim import language as nl

    return nl.bfloat16


def _gen_mask(bs, qh, sa, s_prior, lnc=1, block_len=0):
    def inputs(rng):
        cache = rng.integers(1, s_prior, size=bs)
        return {"pos_ids_hbm": np.repeat(cache, sa)[None, :].astype(np.float32), "bs": bs, "q_head": qh,
                "s_active": sa, "s_prior": s_prior, "block_len": block_len}

    def reference(mods, kw):
        import torch

        ref = mods("nkilib.core.attention.gen_mask_tkg_torch").gen_mask_tkg_hbm_torch_ref
        args = dict(kw, pos_ids_hbm=torch.from_numpy(kw["pos_ids_hbm"]))
        return [ref[lnc](**args).double().numpy()]

    return dict(inputs=inputs, reference=reference, lnc=lnc, atol=0, rtol=0)


GM = "nkilib.core.attention.gen_mask_tkg"
CASES = [
    Case("attention_tkg", "nki-library core/attention_tkg", "B1 H1 S1 prior 128 d64 flat, all in SBUF", LIB, TKG,
         "attention_tkg", **_tkg((1, 1, 1, 128, 256, 64, 0), dict(tp_k_prior=True, qk_in_sb=True, k_out_in_sb=True,
                                                                 out_in_sb=True))),
    Case("attention_tkg", "nki-library core/attention_tkg", "B8 H4 S4 prior 128 d64 flat sink lnc2", LIB, TKG,
         "attention_tkg", **_tkg((8, 4, 4, 128, 256, 64, 0), dict(tp_k_prior=True, qk_in_sb=True, k_out_in_sb=True,
                                                                 out_in_sb=True), lnc=2, sink=True)),
    Case("attention_tkg", "nki-library core/attention_tkg", "B4 H2 S7 prior 256 d128 RoPE + pos-id mask", LIB, TKG,
         "attention_tkg", **_tkg((4, 2, 7, 256, 512, 128, 0), dict(tp_k_prior=True, use_pos_id=True,
                                                                  fuse_rope=True))),
    Case("attention_tkg", "nki-library core/attention_tkg", "B4 H1 S5 prior 2048 d64 block KV 16 sink", LIB, TKG,
         "attention_tkg", **_tkg((4, 1, 5, 2048, 2048, 64, 16), dict(tp_k_prior=True, strided_mm1=False,
                                                                    qk_in_sb=True, k_out_in_sb=True, out_in_sb=True),
                                 sink=True)),
    Case("attention_tkg", "nki-library core/attention_tkg", "B4 H1 S5 prior 2048 d64 block KV 16 lnc2", LIB, TKG,
         "attention_tkg", **_tkg((4, 1, 5, 2048, 2048, 64, 16), dict(tp_k_prior=True, strided_mm1=False,
                                                                    qk_in_sb=True, k_out_in_sb=True, out_in_sb=True),
                                 lnc=2)),
    Case("attention_tkg", "nki-library core/gen_mask_tkg (gen_mask_tkg_hbm)", "B4 H1 S5 prior 1024 flat", LIB, GM,
         "gen_mask_tkg_hbm", **_gen_mask(4, 1, 5, 1024)),
    Case("attention_tkg", "nki-library core/gen_mask_tkg (gen_mask_tkg_hbm)", "B4 H1 S5 prior 4096 flat lnc2", LIB, GM,
         "gen_mask_tkg_hbm", **_gen_mask(4, 1, 5, 4096, lnc=2)),
    Case("attention_tkg", "nki-library core/gen_mask_tkg (gen_mask_tkg_hbm)", "B4 H1 S5 prior 2048 block 16 lnc2", LIB,
         GM, "gen_mask_tkg_hbm", **_gen_mask(4, 1, 5, 2048, lnc=2, block_len=16)),
]
