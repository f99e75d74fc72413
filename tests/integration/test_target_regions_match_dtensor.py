"""The pure region predictor (plans/checkpoint/regions.py) against torch's own answer.

The model is parallelized exactly as the actors do it (DTensor TP + FSDP2) under a fake process
group, once per layout; then, for every rank's mesh coordinate, torch's
`_compute_local_shape_and_global_offset` must give the region the predictor gives, and the
replica dims read off the DTensor placements must be the predicted ones. No Ray, no real ranks.
A vocabulary tp does not divide is checked against what each rank's local tensor really holds,
built as that rank: there DTensor's own answer for FSDP2's strided shard is wrong, and the
checkpoints' `region_at` (actors/parallel/shards.py) is what must agree.
"""
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from rayshard.plans.layout.parallel_layout import MESH_DIM_NAMES, ParallelLayout
from rayshard.plans.training.model_spec import parameter_shapes, preset
from rayshard.plans.checkpoint.regions import tensor_region
from rayshard.actors.parallel.shards import region_at

LAYOUTS = [
    ParallelLayout(), ParallelLayout(dp=2), ParallelLayout(fsdp=2), ParallelLayout(tp=2),
    ParallelLayout(dp=2, tp=2), ParallelLayout(fsdp=3, tp=2), ParallelLayout(fsdp=6),
    ParallelLayout(dp=2, fsdp=2, tp=2), ParallelLayout(dp=3, fsdp=2), ParallelLayout(fsdp=5),
]


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def build(layout, model_config, rank=0, local_shapes=False):
        from torch.distributed.device_mesh import init_device_mesh

        from rayshard.actors.checkpoint.rank_pieces import replicated_dims
        from rayshard.actors.model.transformer import build_on_meta
        from rayshard.actors.parallel.parallelize import parallelize
        from rayshard.actors.model.user_model import build_user_on_meta

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
            user = model_config.user
            model = build_user_on_meta(user).module if user is not None else build_on_meta(model_config)
            parallelize(model, mesh, layout.tp, layout.data_parallel_size, tie_embeddings=model_config.tie_embeddings,
                        plan=model_config.plan)
            if local_shapes:
                return {name: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                        for name, p in model.named_parameters()}
            return {name: (getattr(p, "placements", None), tuple(p.device_mesh.mesh_dim_names) if hasattr(p, "device_mesh") else (),
                           tuple(p.device_mesh.shape) if hasattr(p, "device_mesh") else (), replicated_dims(p, layout))
                    for name, p in model.named_parameters()}
        finally:
            dist.destroy_process_group()

    return build


# A vocabulary no tp here divides (1001 = 7 * 11 * 13), on a model whose other sizes every tp here
# divides: DTensor shards the embedding and the head unevenly (decision 118), and FSDP2 cuts each
# tp rank's uneven piece again.
UNEVEN_VOCAB_LAYOUTS = [ParallelLayout(tp=2), ParallelLayout(tp=3), ParallelLayout(tp=4), ParallelLayout(fsdp=3, tp=2),
                        ParallelLayout(fsdp=2, tp=3), ParallelLayout(dp=2, fsdp=2, tp=2), ParallelLayout(fsdp=5, tp=4)]


def uneven_vocab_model(vocab_size: int = 1001, **changes):
    return preset("tiny", vocab_size=vocab_size, dim=48, n_heads=12, n_kv_heads=12, ffn_dim=96, n_layers=2, **changes)


@pytest.mark.parametrize("layout", UNEVEN_VOCAB_LAYOUTS, ids=str)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_rank_region_of_an_uneven_vocabulary_is_what_the_rank_holds(fake_world, layout, tied):
    model = uneven_vocab_model(tie_embeddings=tied)
    placements = fake_world(layout, model)
    shapes = parameter_shapes(model)
    for rank in range(layout.world_size):
        coords = layout.coords_of(rank)
        held = fake_world(layout, model, rank=rank, local_shapes=True)
        for name, shape in shapes.items():
            spec, dims, mesh_shape, copies = placements[name]
            offsets, sizes = ((0,) * len(shape), shape) if spec is None else \
                region_at(shape, mesh_shape, [getattr(coords, dim) for dim in dims], spec)
            assert sizes == held[name], (name, rank, str(layout))
            predicted = tensor_region(name, shape, layout, coords, model.tp_styles)
            assert sizes == predicted.sizes and (offsets == predicted.offsets or not math.prod(sizes)), (name, rank)
            assert copies == predicted.replicated_over, (name, str(layout))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("model_name", ["untied", "tied", "user"])
def test_every_rank_region_matches_dtensor(fake_world, layout, model_name):
    """"user": the GPT-2 example's own plan (examples/gpt2), predicted from its checkpoint record."""
    if model_name == "user":
        from rayshard.actors.model.user_model import describe_factory

        model = describe_factory("examples.gpt2.model:tiny_gpt2")
    else:
        model = preset("tiny", tie_embeddings=model_name == "tied")
    _assert_regions_match(fake_world, layout, model)


def _assert_regions_match(fake_world, layout, model):
    placements = fake_world(layout, model)
    shapes = parameter_shapes(model)
    assert set(placements) == set(shapes)
    for rank in range(layout.world_size):
        coords = layout.coords_of(rank)
        for name, shape in shapes.items():
            spec, dims, mesh_shape, copies = placements[name]
            if spec is None:
                sizes, offsets = shape, (0,) * len(shape)
            else:
                coordinate = [getattr(coords, dim) for dim in dims]
                sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, spec)
                # Where torch is right (every size tp divides), the checkpoints' own rule agrees with it.
                assert region_at(shape, mesh_shape, coordinate, spec) == (tuple(offsets), tuple(sizes)), (name, rank)
            predicted = tensor_region(name, shape, layout, coords, model.tp_styles)
            if torch.Size(sizes).numel() == 0:
                assert torch.Size(predicted.sizes).numel() == 0, (name, rank)
                continue
            assert (tuple(offsets), tuple(sizes)) == (predicted.offsets, predicted.sizes), (name, rank, str(layout))
            assert copies == predicted.replicated_over, (name, str(layout))
