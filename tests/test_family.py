"""A model family is ONE record (``patches/<family>.py``: a ``family.FamilyPatch`` with its ``CacheSpec``s), data
only: every module of the folder is listed, every dotted path of ours resolves, every diffusers class of the
pinned diffusers resolves, and the cache registry built from the records is the one the package had."""
from __future__ import annotations

from pathlib import Path

import pytest

from diffusers_nki import caching, patches
from diffusers_nki.family import CacheSpec, FamilyPatch, resolve_class, resolve_object

ROOT = Path(__file__).resolve().parents[1]


def test_every_family_file_is_in_modules():
    files = {f.stem for f in (ROOT / "diffusers_nki" / "patches").glob("*.py") if f.name != "__init__.py"}
    listed = {m.__name__.rpartition(".")[2] for m in patches.MODULES}
    assert listed == files
    assert len({f.name for f in patches.families()}) == len(patches.MODULES)


def _ours(fam: FamilyPatch):
    paths = list(fam.swap.values()) + list(fam.modules.values()) + ([fam.setup] if fam.setup else [])
    return paths + [spec.hook for spec in fam.caches]


@pytest.mark.parametrize("fam", patches.families(), ids=lambda f: f.name)
def test_every_dotted_path_resolves(fam):
    for path in _ours(fam):
        assert path.startswith("diffusers_nki."), path
        assert callable(resolve_object(path)), path
    diffusers_paths = list(fam.models) + list(fam.dispatch) + list(fam.swap) + list(fam.modules) + list(fam.stock)
    diffusers_paths += [p for spec in fam.caches for p in spec.models]
    assert [p for p in diffusers_paths if resolve_class(p) is None] == []  # diffusers 0.42.1 has them all


def test_a_path_of_ours_that_does_not_resolve_is_an_error():
    with pytest.raises(ImportError, match="diffusers_nki.processors.base.NoSuchProcessor"):
        resolve_object("diffusers_nki.processors.base.NoSuchProcessor")
    fam = FamilyPatch(name="x", models=("diffusers.models.transformers.transformer_wan.WanTransformer3DModel",),
                      swap={"diffusers.models.transformers.transformer_wan.WanAttnProcessor":
                            "diffusers_nki.processors.wan.NoSuchProcessor"})
    with pytest.raises(ImportError, match="NoSuchProcessor"):
        fam.tables()


def test_the_cache_registry_is_built_from_the_records():
    specs = caching.specs()
    assert list(specs) == ["causal_wan", "skyreels_v2", "anyflow_far", "framepack", "sana_wm"]
    assert all(isinstance(s, CacheSpec) for s in specs.values())
    assert caching.supported_classes() == ["AnyFlowFARTransformer3DModel", "HunyuanVideoFramepackTransformer3DModel",
                                           "SanaWMLTX2RefinerTransformer3DModel", "SkyReelsV2Transformer3DModel"]
    assert caching.not_by_default() == {"framepack": specs["framepack"].not_by_default}
    assert caching.default_config("anyflow_far", None, None).grow is True
    assert caching.default_config("skyreels_v2", None, None).to_dict() == caching.StaticCacheConfig().to_dict()
    assert caching.default_config("causal_wan", None, None) is None  # the pipeline's own window, none without it
    assert caching.default_config("framepack", None, None) is None


def test_a_by_name_cache_serves_a_bare_model_only_when_asked():
    from diffusers_nki.testing import tiny

    model, _ = tiny.tiny_transformer("wan", num_layers=1)
    assert caching.family_of(model) is None
    assert caching.family_for_component(None, "", model) is None
    assert caching.family_for_component(None, "", model, families=("causal_wan",)) == "causal_wan"
