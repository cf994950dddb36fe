"""The pieces of gathers at uneven batches, in one process: the shape check, the padding and the cut."""

from __future__ import annotations

import pytest
import torch

from lightning_aesgd.user_collectives import (
    StepCollectives,
    UnevenGatherError,
    check_rows,
    check_same_shapes,
    padded_rows,
    rows_in_rank_order,
    shape_descriptor,
    shapes_from,
)


def test_equal_shapes_pass_and_unequal_ones_name_every_replicas_shape_and_the_fix():
    check_same_shapes([[12, 3], [12, 3], [12, 3]])
    with pytest.raises(UnevenGatherError, match=r"0: \[12, 3\], 1: \[4, 3\].*HINT: .*all_gather_rows"):
        check_same_shapes([[12, 3], [4, 3]])


def test_padding_appends_zero_rows_and_gradients_reach_only_the_original_rows():
    rows = torch.ones(2, 3, requires_grad=True)
    padded = padded_rows(rows, 5)
    assert padded.shape == (5, 3)
    assert padded[2:].abs().sum() == 0
    (padded * torch.arange(5.0).unsqueeze(1)).sum().backward()
    assert rows.grad.tolist() == [[0.0] * 3, [1.0] * 3]
    assert padded_rows(rows, 2) is rows


def test_gathered_padded_rows_are_cut_back_to_each_replicas_own():
    own = [torch.arange(3), torch.arange(10, 11), torch.arange(20, 22)]
    gathered = torch.stack([padded_rows(rows, 3) for rows in own])
    assert rows_in_rank_order(gathered, [3, 1, 2]).tolist() == [0, 1, 2, 10, 20, 21]


def test_only_collectives_inside_a_training_step_count_and_each_once():
    collectives = StepCollectives()
    collectives.note("barrier")  # outside a step: Lightning's own, e.g. before a checkpoint
    assert collectives.reason() is None
    collectives.watching = True
    for name in ("all_gather", "reduce", "all_gather"):
        collectives.note(name)
    assert collectives.reason() == (
        "the training step calls the strategy's all_gather, reduce, which every replica must join"
    )


def test_shape_descriptors_have_one_length_whatever_the_dimensions_and_give_the_shapes_back():
    tensors = [torch.zeros(()), torch.zeros(4), torch.zeros(4, 3)]
    descriptors = [shape_descriptor(tensor) for tensor in tensors]
    assert len({len(row) for row in descriptors}) == 1  # a 0-dim tensor's too: the gather of them always matches
    assert shapes_from(descriptors) == [[], [4], [4, 3]]
    with pytest.raises(UnevenGatherError, match=r"0: \[\], 1: \[4\]"):
        check_same_shapes(shapes_from(descriptors[:2]))  # a batch of one squeezed to 0-dim on one replica


def test_rows_need_one_trailing_shape_and_at_least_one_dimension():
    assert check_rows([[12, 3], [4, 3]]) == [12, 4]
    for shapes in ([[12, 3], [4, 2]], [[12], []]):
        with pytest.raises(UnevenGatherError, match="HINT: gather tensors of shape"):
            check_rows(shapes)
