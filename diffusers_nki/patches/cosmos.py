"""Cosmos (1.0 / 2.5): its processors call dispatch WITHOUT a backend (they would follow diffusers' process-wide
active backend). patch() replaces each one, per module, by the same processor code bound to our backend
(``patching.dispatch_bound``): nothing process-wide is switched, so other models and other threads are
untouched, and torch.compile traces it as before. (Cosmos pipelines need torchvision; the transformer's
attention does not.)"""
from diffusers_nki.family import FamilyPatch

_M = "diffusers.models.transformers.transformer_cosmos."

PATCH = FamilyPatch(
    name="cosmos",
    models=(_M + "CosmosTransformer3DModel",),
    dispatch=(_M + "CosmosAttnProcessor2_0", _M + "CosmosAttnProcessor2_5"),
    global_backend=True,
    notes=("processors pass no backend to dispatch: each is bound to ours per module (no process-wide switch)",),
)
