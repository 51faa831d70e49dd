"""Cosmos (1.0 / 2.5): its processors call dispatch without a backend, so they follow the active backend;
patch() sets ours active around each forward of the patched model. (Cosmos pipelines need torchvision; the
transformer's attention does not.)"""
from diffusers_nki.patching import FamilyPatch

_M = "diffusers.models.transformers.transformer_cosmos."

PATCH = FamilyPatch(
    name="cosmos",
    models=(_M + "CosmosTransformer3DModel",),
    dispatch=(_M + "CosmosAttnProcessor2_0", _M + "CosmosAttnProcessor2_5"),
    global_backend=True,
    notes=("processors pass no backend to dispatch: the active backend is ours during each forward",),
)
