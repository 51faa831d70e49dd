"""An independent re-implementation, for the tests, of what the published causal-Wan inference loops do
(Self-Forcing 33593df ``pipeline/causal_inference.py``, CausVid ca21150 ``causvid/models/wan/causal_inference.py``,
LongLive 2462895 ``pipeline/interactive_causal_inference.py`` + ``wan/modules/causal_model{,_infinity}.py``),
written from their behaviour, on the STOCK diffusers ``WanTransformer3DModel`` with this module's own
self-attention (nothing of diffusers_nki is used):

* text: embeddings zero-padded to 512 tokens (``text_len``), the padding attended to;
* schedule: the originals' flow-matching table (``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)``
  at 1000 steps); Self-Forcing/LongLive warp their step list through it (``timesteps[1000 - t]``), CausVid
  passes its list as is and looks each timestep's sigma up in the table (nearest entry);
* sampler: x0 = x - sigma v (float64), re-noised to the next step's sigma with ``randn`` of the chunk in their
  ``[B * f, C, h, w]`` layout from torch's global generator; the last step's x0 is the chunk;
* cache: per layer, the UN-rotated K and V of every committed frame (a dict by frame), RoPE applied at every
  call (complex multiplication in float64, Wan's 3-D table from its formula) at absolute frame positions or,
  LongLive's infinite mode, at positions re-based inside the window [sinks | latest frames | the chunk];
  window = sinks + the latest (window - chunk - sink) frames;
* the cache pass over the clean chunk at the context timestep writes the chunk's K/V;
* LongLive's re-cache after a switch (``global_sink``): the last min(L, P) committed frames run in ONE call
  under the new text, attending to each other without causal order; once P > L the sink frames keep their
  old K/V (keys of the call: old sinks + the call's frames from index ``sink`` on, which alone are written).
"""
import torch
import torch.nn.functional as F

TEXT_LEN = 512


def pad_text(pe, length=TEXT_LEN):
    return torch.cat([pe, pe.new_zeros(pe.shape[0], length - pe.shape[1], pe.shape[2])], dim=1)


def flow_table(shift, steps=1000):
    """(timesteps, sigmas) of the originals' training-time flow-matching table."""
    s = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    sig = shift * s / (1 + (shift - 1) * s)
    return sig * 1000, sig


def warp(step_list, shift):
    """Self-Forcing / LongLive ``warp_denoising_step``: (model timesteps, sigmas) of the step list."""
    ts, _ = flow_table(shift)
    ts = torch.cat([ts, torch.zeros(1)])
    out = [float(ts[1000 - int(t)]) for t in step_list]
    return out, [t / 1000 for t in out]


def lookup(step_list, shift):
    """CausVid (no warp): the list as the model's timesteps, sigmas looked up in the table (nearest)."""
    ts, sig = flow_table(shift)
    return [float(t) for t in step_list], [float(sig[torch.argmin((ts - float(t)).abs())]) for t in step_list]


def original_noise(seed):
    """The originals' re-noising noise: torch's global generator, ``randn_like(x.flatten(0, 1))`` with x
    [B, f, C, h, w]; returned in [B, C, f, h, w]."""
    torch.manual_seed(seed)

    def draw(chunk, step, shape):
        B, C, f, h, w = shape
        return torch.randn(B * f, C, h, w).view(B, f, C, h, w).permute(0, 2, 1, 3, 4)

    return draw


def _axis_freqs(dim, n, theta=10000.0):
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.polar(torch.ones(n, dim // 2, dtype=torch.float64), torch.outer(torch.arange(n, dtype=torch.float64),
                                                                                  inv))


def rope(x, frame_pos, hp, wp):
    """Wan's 3-D RoPE of x [B, n_frames * hp * wp, H, D] (interleaved pairs as complex numbers), frame i of x at
    time position frame_pos[i]."""
    B, S, H, D = x.shape
    c = D // 2
    tdim = c - 2 * (c // 3)
    ft = _axis_freqs(2 * tdim, max(frame_pos) + 1)[list(frame_pos)]
    fh = _axis_freqs(2 * (c // 3), hp)
    fw = _axis_freqs(2 * (c // 3), wp)
    n = len(frame_pos)
    freqs = torch.cat([ft.view(n, 1, 1, -1).expand(n, hp, wp, -1), fh.view(1, hp, 1, -1).expand(n, hp, wp, -1),
                       fw.view(1, 1, wp, -1).expand(n, hp, wp, -1)], dim=-1).reshape(1, S, 1, c)
    xc = torch.view_as_complex(x.to(torch.float64).reshape(B, S, H, c, 2))
    return torch.view_as_real(xc * freqs).flatten(3).to(x.dtype)


class _Attn:
    """attn1 of the reference: q/k/v with the module's weights, RoPE and SDPA done here, per ``rollout.spec``."""

    def __init__(self, rollout, layer):
        self.rollout, self.layer = rollout, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        r, spec = self.rollout, self.rollout.spec
        B = hidden_states.shape[0]
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        tpf = r.tpf
        store = r.kv[self.layer]
        qr = rope(q, spec["q_pos"], r.hp, r.wp)
        keys, vals = [], []
        for frame, pos in spec["cached"]:
            ku, vu = store[frame]
            keys.append(rope(ku, [pos], r.hp, r.wp))
            vals.append(vu)
        for i in spec["own"]:
            keys.append(rope(k[:, i * tpf:(i + 1) * tpf], [spec["q_pos"][i]], r.hp, r.wp))
            vals.append(v[:, i * tpf:(i + 1) * tpf])
        kk, vv = torch.cat(keys, dim=1), torch.cat(vals, dim=1)
        out = F.scaled_dot_product_attention(qr.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2))
        for i in spec["write"]:
            store[spec["q_frames"][i]] = (k[:, i * tpf:(i + 1) * tpf].clone(), v[:, i * tpf:(i + 1) * tpf].clone())
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class OriginalRollout:
    """The published loop on a stock Wan model (see the module doc). ``positions``: "absolute" or "window"."""

    def __init__(self, model, block=3, window=None, sink=0, positions="absolute", ctx=0.0):
        self.model, self.block, self.window, self.sink, self.positions, self.ctx = \
            model, block, window, sink, positions, ctx
        self.kv = [dict() for _ in model.blocks]
        self.outputs = {}  # frame -> clean latent [B, C, 1, h, w] (what a re-cache re-encodes)

    def _call(self, x, t, embeds, spec):
        saved = [b.attn1.processor for b in self.model.blocks]
        for i, b in enumerate(self.model.blocks):
            b.attn1.set_processor(_Attn(self, i))
        self.spec = spec
        _, ph, pw = self.model.config.patch_size
        self.hp, self.wp = x.shape[3] // ph, x.shape[4] // pw
        self.tpf = self.hp * self.wp
        try:
            ts = torch.full((x.shape[0],), float(t), dtype=x.dtype)
            return self.model(hidden_states=x, timestep=ts, encoder_hidden_states=pad_text(embeds)).sample
        finally:
            for b, p in zip(self.model.blocks, saved):
                b.attn1.set_processor(p)

    def _window(self, P):
        """Committed frames a chunk starting at P attends to, in temporal order."""
        if self.window is None or P <= self.window - self.block:
            return list(range(P))
        rolling = self.window - self.block - self.sink
        return list(range(self.sink)) + list(range(P - rolling, P))

    def _chunk_spec(self, P, n, commit):
        cached = self._window(P)
        frames = list(range(P, P + n))
        if self.positions == "window":
            pos = list(range(len(cached) + n))
            cpos, qpos = pos[:len(cached)], pos[len(cached):]
        else:
            cpos, qpos = cached, frames
        return dict(q_frames=frames, q_pos=qpos, cached=list(zip(cached, cpos)), own=list(range(n)),
                    write=list(range(n)) if commit else [])

    def chunk(self, noise, P, embeds, schedule, noise_fn, chunk_index, commit=True):
        """One chunk from its initial noise [B, C, n, h, w] at frame P; returns its clean latents."""
        model_ts, sigmas = schedule
        sigmas = list(sigmas) + [0.0]
        x = noise.to(torch.float32)
        n = x.shape[2]
        for i, t in enumerate(model_ts):
            flow = self._call(x.to(self.model.dtype), t, embeds.to(self.model.dtype), self._chunk_spec(P, n, False))
            x0 = (x.double() - sigmas[i] * flow.double()).to(torch.float32)
            if i < len(model_ts) - 1:
                x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * noise_fn(chunk_index, i, x0.shape).to(torch.float32)
            else:
                x = x0
        if commit:
            self._call(x.to(self.model.dtype), self.ctx, embeds.to(self.model.dtype), self._chunk_spec(P, n, True))
        for j in range(n):
            self.outputs[P + j] = x[:, :, j:j + 1]
        return x

    def recache(self, P, embeds):
        """LongLive's ``_recache_after_switch`` (global sink) with P frames committed."""
        L = self.window if self.window is not None else P
        R = min(L, P)
        first = P - R
        frames = list(range(first, P))
        x = torch.cat([self.outputs[f] for f in frames], dim=2)
        keep_sinks = first > 0 and self.sink > 0
        own = [i for i in range(R) if not (keep_sinks and i < self.sink)]
        cached = list(range(self.sink)) if keep_sinks else []
        if self.positions == "window":
            qpos = list(range(R))
            cpos = list(range(self.sink)) if keep_sinks else []
        else:
            qpos, cpos = frames, cached
        spec = dict(q_frames=frames, q_pos=qpos, cached=list(zip(cached, cpos)), own=own, write=own)
        self._call(x.to(self.model.dtype), self.ctx, embeds.to(self.model.dtype), spec)

    def rollout(self, latents, embeds, schedule, noise_fn, switches=None, last_commit=False):
        """All chunks of ``latents`` [B, C, F, h, w]; ``switches`` {chunk index: new embeds} (re-cache first)."""
        out = []
        n = self.block
        chunks = latents.shape[2] // n
        for c in range(chunks):
            if switches and c in switches:
                embeds = switches[c]
                if c:
                    self.recache(c * n, embeds)
            out.append(self.chunk(latents[:, :, c * n:(c + 1) * n], c * n, embeds, schedule, noise_fn, c,
                                  commit=last_commit or c < chunks - 1))
        return out


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def chunk_errors(out, ref):
    return [rel(o, r) for o, r in zip(out, ref)]

