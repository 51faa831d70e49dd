"""One rank of the context-parallel tests (spawned by test_context_parallel.py; not collected by pytest).

    python cp_worker.py RANK WORLD STORE_FILE ULYSSES RING OUT_DIR CASE[,CASE...]

Joins a gloo process group over 127.0.0.1 (file rendezvous: no port to pick), patches
``torch.accelerator.device_count`` to 1 (diffusers' parallel setup divides the rank by it; a CPU build reports 0),
runs each case with ``enable_parallelism(ContextParallelConfig(ulysses_degree, ring_degree))`` and saves what it
saw to OUT_DIR/rank<RANK>.pt: outputs, kernel-op counters, SDPA/flex calls made outside our twin, explain text.
The single-process references are computed by the test itself, in the same run.
"""
import datetime
import functools
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


class Spy:
    """SDPA calls by our torch twin vs anyone else, and flex calls, made while a watched model runs (``watch``;
    the text encoder's own attention is not the transformer's): stock attention there shows up here."""

    def __init__(self):
        self.twin = self.stock = self.flex = 0
        self.depth = 0
        import torch.nn.attention.flex_attention as flex_mod

        sdpa, flex = F.scaled_dot_product_attention, flex_mod.flex_attention

        def counting_sdpa(*a, **k):
            if not self.depth:
                pass
            elif sys._getframe(1).f_code.co_filename.endswith(os.path.join("kernels", "attention_ref.py")):
                self.twin += 1
            else:
                self.stock += 1
            return sdpa(*a, **k)

        def counting_flex(*a, **k):
            self.flex += 1 if self.depth else 0
            return flex(*a, **k)

        F.scaled_dot_product_attention = counting_sdpa
        flex_mod.flex_attention = counting_flex

    def watch(self, model):
        model.register_forward_pre_hook(lambda m, a: setattr(self, "depth", self.depth + 1))
        model.register_forward_hook(lambda m, a, o: setattr(self, "depth", self.depth - 1), always_call=True)

    def snapshot(self):
        return {"twin": self.twin, "stock": self.stock, "flex": self.flex}


def _delta(before, after):
    return {op: {b: after[op][b] - before[op][b] for b in after[op]} for op in after}


def run_case(case, cfg, spy):
    import diffusers_nki
    from diffusers_nki import ops, parallel
    from diffusers_nki.cache import StaticCacheConfig
    from diffusers_nki.testing.tiny import tiny_pipeline, tiny_transformer

    from cp_cases import anyflow_far_kwargs, ANYFLOW_FAR_CACHE, wan_inputs

    res = {}
    if case == "wan":
        model, make = tiny_transformer("wan")
        diffusers_nki.patch(model, backend="torch")
        model.enable_parallelism(config=cfg)
        spy.watch(model)
        c0, s0 = ops.counters(), spy.snapshot()
        with torch.no_grad():
            res["out"] = model(**wan_inputs(make), return_dict=False)[0]
        res["counters"], res["spy"] = _delta(c0, ops.counters()), _spy_delta(s0, spy.snapshot())
        res["layers"] = len(model.blocks)
        res["explain"] = str(diffusers_nki.explain(model))
    elif case in ("anyflow_far", "anyflow_far_compiled", "anyflow_far_sim"):
        pipe = tiny_pipeline("anyflow_far")
        backend = "sim" if case == "anyflow_far_sim" else "torch"  # sim: the NKI kernels (lse too) in the emulator
        diffusers_nki.patch(pipe, backend=backend, cache=StaticCacheConfig(**ANYFLOW_FAR_CACHE))
        pipe.transformer.enable_parallelism(config=cfg, cp_plan=parallel.cp_plan(pipe.transformer))
        spy.watch(pipe.transformer)
        timer = None
        if case == "anyflow_far_compiled":  # regional compilation: the blocks (our collectives inside) compile once
            from diffusers_nki_lab.bench._measure import ChunkTimer, GraphCounter

            counter, marks = GraphCounter(), []
            pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
            timer = ChunkTimer(pipe.transformer, on_chunk=lambda s: marks.append(counter.graphs))
            timer.__enter__()
        c0, s0 = ops.counters(), spy.snapshot()
        res["out"] = pipe(**anyflow_far_kwargs()).frames
        if timer is not None:
            timer.__exit__(None, None, None)
            res["graphs_after_each_chunk"] = marks
            return res
        res["counters"], res["spy"] = _delta(c0, ops.counters()), _spy_delta(s0, spy.snapshot())
        res["explain"] = str(diffusers_nki.explain(pipe))
        hook = pipe.transformer._diffusers_hook.get_hook("diffusers_nki.static_cache")
        res["buffers"] = tuple(hook.state.buffers.shape)
        res["stats"] = dict(hook.state.stats)
    elif case in ("causal_wan", "causal_wan_compiled"):
        from cp_cases import CAUSAL_WAN_CACHE, causal_wan_direct, causal_wan_kwargs

        pipe = tiny_pipeline("causal_wan")
        diffusers_nki.patch(pipe, backend="torch", cache=StaticCacheConfig(**CAUSAL_WAN_CACHE))  # cache FIRST
        plan = parallel.cp_plan(pipe.transformer)
        pipe.transformer.enable_parallelism(config=cfg, cp_plan=plan)
        if case == "causal_wan_compiled":  # regional compilation: the blocks (our collectives inside) compile once
            from diffusers_nki_lab.bench._measure import GraphCounter

            counter, marks = GraphCounter(), []
            pipe.transformer.compile_repeated_blocks(backend=counter, dynamic=False)
            res["out"] = pipe(**causal_wan_kwargs(), callback_on_step_end=lambda p, i, t, kw: marks.append(
                counter.graphs) or {}).frames
            res["graphs_after_each_step"] = marks
            return res
        spy.watch(pipe.transformer)
        c0, s0 = ops.counters(), spy.snapshot()
        res["out"] = pipe(**causal_wan_kwargs()).frames
        res["counters"], res["spy"] = _delta(c0, ops.counters()), _spy_delta(s0, spy.snapshot())
        res["explain"] = str(diffusers_nki.explain(pipe))
        res["plan"] = plan
        hook = pipe.transformer._diffusers_hook.get_hook("diffusers_nki.static_cache")
        res["buffers"] = tuple(hook.last.buffers.shape)
        res["layers"] = len(pipe.transformer.blocks)
        c0 = ops.counters()
        res["direct"], res["stock"] = causal_wan_direct(pipe.transformer)
        res["direct_counters"] = _delta(c0, ops.counters())
        from cp_cases import causal_wan_session

        res["session"] = causal_wan_session(pipe)  # prompt switches (re-cache calls) and a reset, sharded
    elif case == "krea":
        res.update(krea_case(cfg))
    elif case == "longlive2":  # per-token timesteps, shot sinks and RoPE offsets, 48-channel latents, sharded
        from cp_cases import longlive2_cache, longlive2_pipeline, longlive2_session

        pipe = longlive2_pipeline()
        diffusers_nki.patch(pipe, backend="torch", cache=longlive2_cache(pipe))  # cache FIRST
        pipe.transformer.enable_parallelism(config=cfg, cp_plan=parallel.cp_plan(pipe.transformer))
        spy.watch(pipe.transformer)
        c0, s0 = ops.counters(), spy.snapshot()
        res["out"], res["slots"] = longlive2_session(pipe)
        res["counters"], res["spy"] = _delta(c0, ops.counters()), _spy_delta(s0, spy.snapshot())
        hook = pipe.transformer._diffusers_hook.get_hook("diffusers_nki.static_cache")
        res["buffers"] = tuple(hook.last.buffers.shape)
    elif case == "templates":
        res.update(templates_case(cfg))
    else:
        raise ValueError(case)
    return res


def krea_case(cfg):
    """Krea Realtime's rollouts (cp_cases.KREA_ROLLOUTS: KV re-computation + the attention bias) on the patched
    causal Wan pipeline with the cache sharded per rank; then a geometry the layout cannot split (3 tokens per
    frame), which must raise the clear error."""
    import diffusers_nki
    from diffusers_nki import ops, parallel
    from diffusers_nki.testing.tiny import tiny_pipeline

    from cp_cases import KREA_ROLLOUTS, krea_kwargs, krea_pipeline

    base = tiny_pipeline("causal_wan")
    res = {"outs": [], "counters": [], "stats": [], "buffers": []}
    for i, ro in enumerate(KREA_ROLLOUTS):
        pipe = krea_pipeline(base, ro["block"], ro["recompute"], ro["bias"])
        if i == 0:  # the cache FIRST, then the parallel config (its plan is {}: the cache shards its own tokens)
            diffusers_nki.patch(pipe, backend="torch")
            res["plan"] = parallel.cp_plan(pipe.transformer)
            pipe.transformer.enable_parallelism(config=cfg, cp_plan=res["plan"])
        c0 = ops.counters()
        with torch.no_grad():
            res["outs"].append(pipe(**krea_kwargs(**ro)).frames)
        res["counters"].append(_delta(c0, ops.counters()))
        hook = pipe.transformer._diffusers_hook.get_hook("diffusers_nki.static_cache")
        res["stats"].append(dict(hook.last.stats))
        res["buffers"].append(tuple(hook.last.buffers.shape))
    res["explain"] = str(diffusers_nki.explain(pipe))
    try:  # 48x16 px: 3 tokens per frame, not a multiple of the ranks
        with torch.no_grad():
            pipe(**krea_kwargs(**dict(KREA_ROLLOUTS[0], frames=6), height=48, width=16))
        res["odd_error"] = None
    except ValueError as e:
        res["odd_error"] = str(e)
    res["layers"] = len(base.transformer.blocks)
    return res


def _spy_delta(a, b):
    return {k: b[k] - a[k] for k in a}


def templates_case(cfg):
    """diffusers' own templated Ulysses / ring attention around our forward/backward ops on random q/k/v (each rank
    its sequence slice), against SDPA on the whole tensors: forward with the torch and the sim (emulated NKI kernel,
    lse output) backends, backward (dq, dk, dv) with the torch twin."""
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from diffusers_nki import compat, ops, parallel
    from diffusers_nki.backends import Route

    r, w = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", cfg.mesh_shape, mesh_dim_names=cfg.mesh_dim_names)
    pc = ParallelConfig(context_parallel_config=cfg)
    pc.setup(r, w, torch.device("cpu"), mesh=mesh)
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 40, 4, 8
    q, k, v, do = (torch.randn(B, S, H, D, generator=g) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qr, kr, vr))).transpose(1, 2)
    ref.backward(do)
    f = parallel.layout(pc).flat_rank
    n = S // w
    sl = slice(f * n, (f + 1) * n)
    out = {}
    for backend in ("torch", "sim"):
        ql, kl, vl = (t[:, sl].clone().requires_grad_(backend == "torch") for t in (q, k, v))
        fwd = functools.partial(parallel.forward_op, route=Route(backend, strict=True))
        c0 = ops.counters()
        o = compat.templated_cp_attention(ql, kl, vl, None, 0.0, False, None, False, False, fwd, parallel.backward_op,
                                          pc)
        out[f"{backend}_counters"] = _delta(c0, ops.counters())
        out[f"{backend}_err"] = (o.detach() - ref[:, sl].detach()).abs().max().item()
        if backend == "torch":
            o.backward(do[:, sl])
            pairs = ((ql, qr), (kl, kr), (vl, vr))
            out["grad_err"] = max((a.grad - b.grad[:, sl]).abs().max().item() for a, b in pairs)
    out["grad_scale"] = max(t.grad.abs().max().item() for t in (qr, kr, vr))
    return out


def main():
    rank, world, store, U, R, out_dir, cases = sys.argv[1:8]
    rank, world, U, R = int(rank), int(world), int(U), int(R)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.accelerator.device_count = lambda: 1  # diffusers: device = rank % torch.accelerator.device_count()
    from diffusers import ContextParallelConfig

    spy = Spy()
    results = {}
    for case in cases.split(","):
        results[case] = run_case(case, ContextParallelConfig(ulysses_degree=U, ring_degree=R), spy)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
