"""The VAE layouts the budget reads and the argument checks of diffusers_nki.vae_parallel (no processes)."""
import pytest

from diffusers_nki import vae_parallel
from diffusers_nki.vae_parallel import DecodeLayout, implemented_layouts, split_rows


def test_rows_split_contiguously_first_ranks_one_more():
    assert split_rows(7, 3) == [3, 2, 2] and split_rows(5, 4) == [2, 1, 1, 1] and split_rows(60, 8) == [8] * 4 + [7] * 4
    assert sum(split_rows(105, 8)) == 105


def test_implemented_layouts_are_the_shared_one_and_every_disaggregated_split():
    lays = implemented_layouts(8)
    assert all(isinstance(x, DecodeLayout) and x.implemented for x in lays)
    assert [(x.name, x.w_dit, x.w_vae, x.overlap) for x in lays[:2]] == [("shared", 8, 8, False),
                                                                         ("disaggregated", 7, 1, True)]
    assert [(x.w_dit, x.w_vae) for x in lays if x.name == "disaggregated"] == [(8 - v, v) for v in range(1, 8)]
    assert all(x.cores == 8 for x in lays)
    assert implemented_layouts(1) == [DecodeLayout("shared", 1, 1, overlap=False)]
    lays[1].check(latent_height=1)
    with pytest.raises(ValueError, match="latent height of 3 rows cannot be split over w_vae=8"):
        lays[0].check(latent_height=3)
    with pytest.raises(ValueError, match="cores=0 must be an int >= 1"):
        implemented_layouts(0)


def test_distributed_objects_need_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        vae_parallel.HeightShards(4)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        vae_parallel.Disaggregation(1, 1)
    from diffusers_nki.pipelines.disaggregated import disaggregate

    with pytest.raises(TypeError, match="split must be a Disaggregation"):
        disaggregate(object(), (1, 1))
